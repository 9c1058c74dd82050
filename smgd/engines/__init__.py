"""Engine clients, one per wire family (:mod:`~smgd.engines.sglang`,
:mod:`~smgd.engines.vllm`, :mod:`~smgd.engines.tokenspeed`) over :mod:`~smgd.engines.base`.

:func:`smgd.supervise.build_engine_client` builds them from ``[[engines]]`` entries.
"""
