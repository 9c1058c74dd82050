"""What smgd sends the engine: INIT on the handshake socket, ADD and ABORT on the input socket.

A payload the engine cannot decode is dropped silently and a request it rejects comes back as a
bare ``"abort"``, so :func:`encode_add` validates what the engine would refuse before sending.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from smgd.errors import InvalidRequest
from smgd.wire.common import grammar_fields
from smgd.wire.tokenspeed.structs import (
    REQ_ABORT,
    REQ_ADD,
    HandshakeAddresses,
    HandshakeInit,
    SamplingParams,
    TokenizedGenerateReqInput,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from smgd.wire.common import GenerateRequest


# TokenSpeed's "top_k disabled" value (sampling_params._TOP_K_DISABLED); -1 on the API side.
TOP_K_DISABLED = 1 << 30
# The fused top-k/top-p kernel sorts at most 128 candidates; verify() rejects top_k >= 128.
TOP_K_MAX = 127
# TokenSpeed's greedy threshold (sampling_params._SAMPLING_EPS): below it, temperature 0 means
# greedy, spelled temperature 1.0 + top_k 1 + seed 0.
GREEDY_EPS = 1e-6
# Greedy requests get this pinned seed, like TokenSpeed's own __post_init__: tie-breaking then
# does not depend on the rid (SMG leaves it unset; see wire/tokenspeed.md §3.10 item 4).
GREEDY_SEED = 0

_ENC = msgspec.msgpack.Encoder()


def encode_init(inputs: Sequence[str], outputs: Sequence[str]) -> list[bytes]:
    """INIT, the reply to HELLO (prefix the engine's identity on the ROUTER).

    TokenSpeed dials ``inputs[0]`` and ``outputs[0]``; it raises if either is missing.
    """
    if not inputs or not outputs:
        raise ValueError("INIT needs at least one input and one output address")
    init = HandshakeInit(addresses=HandshakeAddresses(inputs=list(inputs), outputs=list(outputs)))
    return [_ENC.encode(init)]


def _check_sampling(req: GenerateRequest, max_model_len: int | None) -> None:
    """The engine's ``verify()`` and logprob gates, raised as 400s before sending.

    A request the engine rejects only comes back as a bare "abort", so say why up front.
    """
    s = req.sampling
    checks: list[tuple[bool, str, str]] = [
        (s.temperature >= 0.0, "temperature", f"must be non-negative, got {s.temperature}"),
        (0.0 < s.top_p <= 1.0, "top_p", f"must be in (0, 1], got {s.top_p}"),
        (0.0 <= s.min_p <= 1.0, "min_p", f"must be in [0, 1], got {s.min_p}"),
        (s.top_k <= TOP_K_MAX, "top_k", f"must be at most {TOP_K_MAX} or -1, got {s.top_k}"),
        (abs(s.frequency_penalty) <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
        (abs(s.presence_penalty) <= 2.0, "presence_penalty", "must be in [-2, 2]"),
        (0.0 <= s.repetition_penalty <= 2.0, "repetition_penalty", "must be in [0, 2]"),
        (s.max_tokens >= 0, "max_tokens", f"must be at least 0, got {s.max_tokens}"),
        (0 <= s.min_tokens <= s.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
        (s.logprobs in (None, 0), "top_logprobs", "TokenSpeed returns only sampled-token logprobs"),
        (all(k >= 0 for k in s.logit_bias or ()), "logit_bias", "token ids must be >= 0"),
    ]
    if max_model_len is not None:
        limit = max_model_len - 1
        ok = len(req.prompt_ids) <= limit
        checks.append((ok, "prompt", f"{len(req.prompt_ids)} tokens exceed the limit of {limit}"))
    for ok, param, why in checks:
        if not ok:
            raise InvalidRequest(f"{param} {why}", param=param)


def to_wire_sampling(req: GenerateRequest) -> SamplingParams:
    """Common sampling → TokenSpeed's form, normalized the way its own ``__post_init__`` does.

    Greedy (temperature < 1e-6) becomes temperature 1.0 + top_k 1 + seed 0; top_k -1 (or 0)
    becomes the 1<<30 sentinel; no stop ids becomes nil. ``is_normalized`` stays false so the
    engine still derives ``stop_strs`` and the rid-based seed itself. Stop strings and EOS ids
    are never sent: smgd matches stop strings itself and TokenSpeed knows its own EOS.
    """
    s = req.sampling
    temperature, top_k, seed = float(s.temperature), s.top_k, s.seed
    if s.greedy:
        temperature, top_k = 1.0, 1
    if top_k == 1:
        seed = GREEDY_SEED
    if top_k <= 0:
        top_k = TOP_K_DISABLED
    stop_ids = list(set(s.stop_token_ids)) if s.stop_token_ids else None  # set order, as Python
    bias = {str(k): float(v) for k, v in s.logit_bias.items()} if s.logit_bias else None
    json_schema, regex, ebnf = grammar_fields(s.structured)  # SGLang's three fields, same form
    return SamplingParams(
        max_new_tokens=s.max_tokens,
        stop_token_ids=stop_ids,
        temperature=temperature,
        top_p=float(s.top_p),
        top_k=top_k,
        min_p=float(s.min_p),
        frequency_penalty=float(s.frequency_penalty),
        presence_penalty=float(s.presence_penalty),
        repetition_penalty=float(s.repetition_penalty),
        min_new_tokens=s.min_tokens,
        json_schema=json_schema,
        regex=regex,
        ebnf=ebnf,
        ignore_eos=s.ignore_eos,
        logit_bias=bias,
        seed=seed,
    )


def to_wire_request(req: GenerateRequest) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=req.rid,
        input_ids=list(req.prompt_ids),
        sampling_params=to_wire_sampling(req),
        return_logprob=req.sampling.logprobs is not None,
        stream=req.stream,
    )


def encode_add(req: GenerateRequest, *, max_model_len: int | None = None) -> list[bytes]:
    """``[0x00, payload]`` for one request, in TokenSpeed 0.1.1's full 25-element form.

    Raises :class:`InvalidRequest` for what the engine would reject (it would answer with a
    bare abort, or for a prompt longer than ``max_model_len - 1`` silently truncate output).
    """
    _check_sampling(req, max_model_len)
    return [REQ_ADD, _ENC.encode(to_wire_request(req))]


def encode_request(msg: TokenizedGenerateReqInput) -> list[bytes]:
    """``[0x00, payload]`` for an already-built wire struct."""
    return [REQ_ADD, _ENC.encode(msg)]


def encode_abort(rids: Iterable[str]) -> list[bytes]:
    """``[0x01, msgpack list[str]]``. The engine never answers it; finish the stream locally."""
    rid_list = list(rids)
    if not rid_list or not all(rid_list):
        raise ValueError("abort needs at least one non-empty rid")
    return [REQ_ABORT, _ENC.encode(rid_list)]
