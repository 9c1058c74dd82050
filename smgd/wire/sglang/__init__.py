"""SGLang 0.5.23 TokenizerManager <-> Scheduler wire (msgpack mode), sans-IO.

smgd plays SGLang's TokenizerManager: it PUSHes ``TokenizedGenerateReqInput`` / ``AbortReq`` /
control requests to a headless scheduler (``SGLANG_USE_PICKLE_IPC=0``; the same frames with or
without ``--skip-tokenizer-init``) and PULLs ``BatchTokenIDOutput`` / ``AbortReq`` echoes /
``HealthCheckOutput`` back.

One module per role; import each name from the module that defines it:

* :mod:`.structs` -- the mirrors of SGLang's messages (field order = wire order) and its tags;
* :mod:`.arrays` -- token id arrays (msgpack ext type 1);
* :mod:`.encode` -- what smgd sends: generate, abort, health-check and control requests;
* :mod:`.decode` -- the hot path (:func:`~.decode.decode_output`), and request / any-message
  decoders for the mock engine and tests;
* :mod:`.engine_side` -- what the scheduler sends, written for the mock engine;
* :mod:`.jsonform` -- the ``smgd wire`` JSON form.
"""
