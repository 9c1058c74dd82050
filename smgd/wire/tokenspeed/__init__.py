"""TokenSpeed 0.1.1 direct-ZMQ wire (sans-IO): the headless scheduler's router side.

Topology (the router binds everything, the engine dials in): a **tcp** handshake ROUTER (the engine
only ever dials ``tcp://{--data-parallel-address}:{--data-parallel-rpc-port}``), an input ROUTER
and an output PULL, which may be ``ipc://``. Engine identities are 2-byte little-endian engine
indices. Handshake: HELLO → INIT (our data-plane addresses) → READY on the handshake socket, then
one registration map (``WireEngineCoreReadyResponse``) on the input socket; the engine is ready
once both READY and the registration arrived. Handshake messages are msgpack **maps**.

Data plane (msgspec ``array_like`` structs; a tagged struct's element 0 is its class name):

* request ``[type byte, payload]``: ADD ``0x00`` + ``TokenizedGenerateReqInput`` (the shortest
  valid prefix has 6 elements, 0.1.1 writes 25), ABORT ``0x01`` + ``list[str]`` of rids;
* output, one frame per engine step: ``BatchTokenIDOutSlim`` columns (token *deltas*, finish
  ``""|stop|length|abort``, cumulative usage, sampled-token logprobs, then ``engine_index`` and
  the load tail ``num_running, num_waiting, kv_active_pages, kv_total_pages``), or the raw frame
  ``ENGINE_CORE_DEAD``.

Engine behaviour the caller must know: a request smgd aborts never gets a terminal frame (finish
it locally); a payload the engine cannot decode is dropped silently (so validate before sending:
:func:`~.encode.encode_add` does); a request the engine rejects comes back as a bare ``"abort"``,
mapped to an ABORT finish with status 400.

One module per role; import each name from the module that defines it:

* :mod:`.structs` -- the mirrors of TokenSpeed's structs and handshake maps;
* :mod:`.encode` -- what smgd sends: INIT, ADD (validated first) and ABORT;
* :mod:`.decode` -- the hot path (:func:`~.decode.decode_output`), the handshake and the
  registration, and requests as the engine reads them (for the mock engine);
* :mod:`.engine_side` -- what the engine sends, written for the mock engine;
* :mod:`.jsonform` -- the ``smgd wire`` JSON form.
"""
