"""vLLM V1 EngineCore wire (the front end's side and the engine core's), sans-IO."""
