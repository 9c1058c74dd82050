"""What an engine client is and reports: its state, its occupancy, its statistics."""

from __future__ import annotations

import enum

import msgspec

from smgd.wire.common import EngineLoad


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class Occupancy(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine holds of smgd's requests, in the model-server protocol's terms
    (docs/reference/metrics.md, "Gateway API Inference Extension").

    From the engine's own load report where its wire carries one, clamped to what smgd has in
    flight there (a snapshot can predate the last finish). Otherwise ``estimated``: requests
    in flight beyond the handshake's ``max_num_seqs`` wait, the oldest run (the schedulers
    admit first come, first served), and the KV share is the running requests' prompt and
    output tokens over the handshake's KV capacity (shared prefixes counted per request).
    """

    running: int  # in the engine's running batch
    waiting: int  # in the engine's own queue; smgd's admission queue is separate
    kv_usage: float | None  # 0-1; None: neither reported nor estimable
    estimated: bool


class EngineStatistics(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    wire: str
    state: str
    in_flight: int
    requests_total: int
    tokens_total: int
    decode_errors: int
    last_error: str | None
    load: EngineLoad | None
    max_model_len: int | None
    queue_depth: int
    rejected_total: int
