"""TokenSpeed's direct-ZMQ wire (the router's side and the headless scheduler's), sans-IO."""
