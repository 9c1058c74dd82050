"""SGLang's TokenizerManager <-> Scheduler wire (msgpack mode), sans-IO."""
