"""The engine core's side of the vLLM wire, for the mock engine: handshake statuses, the ready
response and output messages written as vLLM's MsgpackEncoder writes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import msgspec
from msgspec.msgpack import Ext

from smgd.wire.vllm.structs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    HandshakeStatus,
    LogprobsLists,
    LogprobsTensors,
    ReadyResponse,
    Tensor,
)
from smgd.wire.vllm.tensors import make_tensor

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.wire.common import TokenLogprob

_ENCODER: Final = msgspec.msgpack.Encoder()

# vLLM's VLLM_MSGPACK_ZERO_COPY_THRESHOLD default: arrays of at least this many bytes travel in
# their own frame. Must match the engine's setting for byte-identical outputs from the mock.
ZERO_COPY_THRESHOLD: Final = 256


def encode_hello(*, local: bool = True, headless: bool = False) -> list[bytes]:
    return [_ENCODER.encode(HandshakeStatus("HELLO", local, headless))]


def encode_ready(
    *, local: bool = True, headless: bool = False, parallel_config_hash: str | None = None
) -> list[bytes]:
    """The READY status message (handshake socket)."""
    return [_ENCODER.encode(HandshakeStatus("READY", local, headless, parallel_config_hash))]


def encode_ready_response(resp: ReadyResponse) -> list[bytes]:
    """The engine's first input-socket message (for the mock engine)."""
    return [_ENCODER.encode(resp)]


def _move_big_arrays(obj: Any, aux: list[bytes], threshold: int) -> None:
    """Give every inline array of at least ``threshold`` bytes its own frame, visiting arrays
    in encoding order, which is the order vLLM's ``enc_hook`` numbers its aux buffers."""
    if isinstance(obj, Tensor):
        if isinstance(obj.data, Ext) and obj.shape:
            raw = bytes(obj.data.data)
            if len(raw) < threshold:
                return
            aux.append(raw)
            obj.data = len(aux)
        return
    if isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            _move_big_arrays(getattr(obj, name), aux, threshold)
    elif isinstance(obj, list):
        for item in obj:
            _move_big_arrays(item, aux, threshold)
    elif isinstance(obj, dict):
        for item in obj.values():
            _move_big_arrays(item, aux, threshold)


def encode_outputs(
    outputs: EngineCoreOutputs,
    *,
    aux: Sequence[bytes] = (),
    zero_copy_threshold: int = ZERO_COPY_THRESHOLD,
) -> list[bytes]:
    """Output frames exactly as vLLM's MsgpackEncoder writes them.

    ``aux``: the frames that arrays already pointing at an aux index refer to (when
    re-encoding a decoded message). Inline arrays (``make_tensor``) of at least the threshold
    move to new aux frames after them, as vLLM does (this mutates ``outputs``).
    """
    frames = list(aux)
    _move_big_arrays(outputs, frames, zero_copy_threshold)
    return [_ENCODER.encode(outputs), *frames]


def encode_engine_dead() -> list[bytes]:
    return [ENGINE_CORE_DEAD]


def logprobs_lists(
    token_ids: list[list[int]], logprobs: list[list[float]], ranks: list[int]
) -> LogprobsLists:
    """Sampled logprobs for ``n`` positions, as vLLM's sampler produces them (for the mock)."""
    rows, cols = len(token_ids), len(token_ids[0]) if token_ids else 0
    return LogprobsLists(
        make_tensor("<i4", [rows, cols], token_ids),
        make_tensor("<f4", [rows, cols], logprobs),
        make_tensor("<i8", [rows], ranks),
    )


def prompt_logprobs_tensors(rows: Sequence[TokenLogprob]) -> LogprobsTensors:
    """Prompt logprobs of tokens 1.. as vLLM's engine sends them (for the mock): ``[P-1, K+1]``
    ids and values, column 0 the prompt token, and its ranks."""
    ids = [[r.token_id, *(t.token_id for t in r.top or ())] for r in rows]
    vals = [[r.logprob, *(t.logprob for t in r.top or ())] for r in rows]
    cols = len(ids[0]) if ids else 0
    return LogprobsTensors(
        make_tensor("<i4", [len(ids), cols], ids),
        make_tensor("<f4", [len(ids), cols], vals),
        make_tensor("<i8", [len(ids)], [r.rank if r.rank is not None else 1 for r in rows]),
    )
