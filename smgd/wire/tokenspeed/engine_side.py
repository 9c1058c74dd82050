"""The engine's side of the TokenSpeed wire, for the mock engine: its identity, HELLO / READY,
the registration map and output frames, laid out as TokenSpeed 0.1.1 writes them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from smgd.wire.common import Finish, FinishReason
from smgd.wire.tokenspeed.structs import (
    ENGINE_CORE_DEAD,
    BatchTokenIDOutSlim,
    ReadyMessage,
    ReadyResponse,
)

if TYPE_CHECKING:
    from collections.abc import Sequence


class OutputRow(msgspec.Struct, kw_only=True):
    """One request's column entries in a ``BatchTokenIDOutSlim`` (mock side)."""

    rid: str
    output_ids: list[int]
    finished_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprob_vals: list[float] = msgspec.field(default_factory=list)
    logprob_ids: list[int] = msgspec.field(default_factory=list)


_ENC = msgspec.msgpack.Encoder()


def encode_identity(engine_index: int) -> bytes:
    """The engine's ZMQ identity: its index as 2 bytes, little-endian."""
    if not 0 <= engine_index <= 0xFFFF:
        raise ValueError(f"engine index {engine_index} does not fit 2 bytes")
    return engine_index.to_bytes(2, "little")


def encode_hello(*, local: bool = True, headless: bool = True) -> bytes:
    return _ENC.encode(ReadyMessage(status="HELLO", local=local, headless=headless))


def encode_ready(*, local: bool = True, headless: bool = True) -> bytes:
    return _ENC.encode(ReadyMessage(status="READY", local=local, headless=headless))


def encode_registration(response: ReadyResponse) -> bytes:
    """Mock side: the registration frame the engine sends on its input DEALER."""
    return _ENC.encode(response)


def finish_to_wire(finish: Finish | None) -> str:
    """Mock side: a common Finish → TokenSpeed's finish string (errors travel as aborts)."""
    if finish is None:
        return ""
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(finish.reason, "abort")


def encode_output(
    rows: Sequence[OutputRow],
    *,
    engine_index: int = 0,
    num_running: int = 0,
    num_waiting: int = 0,
    kv_active_pages: int = 0,
    kv_total_pages: int = 0,
) -> list[bytes]:
    """Mock side: one ``BatchTokenIDOutSlim`` frame, laid out as TokenSpeed's ``from_full``."""
    batch = BatchTokenIDOutSlim(
        rids=[r.rid for r in rows],
        output_ids=[list(r.output_ids) for r in rows],
        finished_reasons=[r.finished_reason for r in rows],
        prompt_tokens=[r.prompt_tokens for r in rows],
        completion_tokens=[r.completion_tokens for r in rows],
        cached_tokens=[r.cached_tokens for r in rows],
        output_token_logprobs_val=[list(r.logprob_vals) for r in rows],
        output_token_logprobs_idx=[list(r.logprob_ids) for r in rows],
        engine_index=engine_index,
        num_running=num_running,
        num_waiting=num_waiting,
        kv_active_pages=kv_active_pages,
        kv_total_pages=kv_total_pages,
    )
    return [_ENC.encode(batch)]


def encode_engine_dead() -> list[bytes]:
    return [ENGINE_CORE_DEAD]
