"""The mock engine on TokenSpeed's wire: it dials smgd like one headless scheduler rank.

Engine side of the handshake (identity = engine index, 2 bytes LE): DEALER → smgd's handshake
ROUTER, HELLO; INIT names the input/output addresses; connect the input DEALER and the output
PUSH; READY; then the registration map on the input DEALER (with ``prefix_granularity`` as 0.1.1
writes it, or the older ``block_size``).

TokenSpeed behaviour it reproduces: an undecodable payload is dropped silently; a client abort
gets no output at all; a request the engine refuses (``n != 1``, logprobs while they are
disabled) gets a bare terminal ``"abort"``; every output batch carries ``engine_index`` and the
load tail; :meth:`TokenspeedMockWire.request_death` makes the next step send
``ENGINE_CORE_DEAD``, as TokenSpeed's ``EventLoop.close()`` does.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

import msgspec
import zmq

from smgd.errors import WireError
from smgd.mock.engine import GARBAGE, connect_data_sockets, record
from smgd.mock.scheduler import MockFinish, MockRequest, MockScheduler, StepOutput
from smgd.wire.tokenspeed.decode import decode_init, decode_request
from smgd.wire.tokenspeed.engine_side import (
    OutputRow,
    encode_engine_dead,
    encode_hello,
    encode_identity,
    encode_output,
    encode_ready,
    encode_registration,
)
from smgd.wire.tokenspeed.structs import AbortRequest, HandshakeInit, ReadyResponse
from smgd.zmq_trio import TrioSocket

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("smgd.mock.tokenspeed")

RegistrationKey = Literal["prefix_granularity", "block_size"]
# TokenSpeed's page size on most models; only reported, nothing here pages.
PAGE_TOKENS = 64
# Unset max_new_tokens means "until the context cap"; the mock has no real cap, 128 is plenty.
DEFAULT_MAX_NEW_TOKENS = 128


class TokenspeedMockWire:
    def __init__(
        self,
        handshake: str,
        *,
        engine_index: int = 0,
        context_len: int = 4096,
        max_batch: int = 256,
        dp_size: int = 1,
        registration_key: RegistrationKey = "prefix_granularity",
        enable_logprobs: bool = True,
    ) -> None:
        self.handshake = handshake
        self.identity = encode_identity(engine_index)
        self.engine_index = engine_index
        self.context_len = context_len
        self.max_batch = max_batch
        self.dp_size = dp_size
        self.registration_key = registration_key
        self.enable_logprobs = enable_logprobs
        self.init: HandshakeInit | None = None
        self.received: list[str] = []  # every rid an ADD arrived for
        self.aborts: list[str] = []  # every rid an ABORT named
        self.dropped = 0  # undecodable payloads, silently dropped
        self._client_aborted: set[str] = set()
        self._rejected: list[tuple[str, int]] = []
        self._logprobs: set[str] = set()
        self._die = False

    def request_death(self) -> None:
        self._die = True

    def registration(self) -> bytes:
        resp = ReadyResponse(
            max_model_len=self.context_len,
            num_gpu_blocks=self.context_len * self.max_batch // PAGE_TOKENS,
            prefix_granularity=PAGE_TOKENS,
            vllm_version="tokenspeed-0.1.1-mock",
            data_parallel_size=self.dp_size,
            data_parallel_rank=self.engine_index,
            max_num_seqs=self.max_batch,
            kv_cache_size_tokens=self.context_len * self.max_batch,
        )
        if self.registration_key == "prefix_granularity":
            return encode_registration(resp)
        fields = msgspec.to_builtins(resp)
        fields["block_size"] = fields.pop("prefix_granularity")
        return msgspec.msgpack.encode(fields)

    async def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[TrioSocket, TrioSocket]:
        hs = TrioSocket(ctx.socket(zmq.DEALER))
        try:
            hs.socket.setsockopt(zmq.LINGER, 0)
            hs.socket.setsockopt(zmq.IDENTITY, self.identity)
            hs.socket.connect(self.handshake)
            await hs.send_multipart([encode_hello()])
            reply = await hs.recv_multipart(copy=True)
            self.init = init = decode_init(reply[-1])  # the last frame, like TokenSpeed
            in_sock, out_sock = connect_data_sockets(
                ctx, self.identity, init.addresses.inputs[0], init.addresses.outputs[0]
            )
            await hs.send_multipart([encode_ready()])
            await in_sock.send_multipart([self.registration()])
            return in_sock, out_sock
        finally:
            hs.close()

    def on_request(self, frames: Sequence[bytes], sched: MockScheduler) -> list[list[bytes]]:
        try:
            msg = decode_request(frames)
        except WireError as exc:
            self.dropped += 1  # TokenSpeed logs and drops; the sender never hears of it
            log.warning("mock tokenspeed: dropping undecodable request: %s", exc)
            return []
        if isinstance(msg, AbortRequest):
            for rid in msg.rids:
                record(self.aborts, rid)
                # Only a request still queued or running answers (or not) to it: the abort of
                # one that finished (the client hung up as it ended) kept its rid here for good.
                if sched.abort(rid):
                    self._client_aborted.add(rid)
                else:  # (a request the "lose" fault dropped: it never finishes in a step)
                    self._logprobs.discard(rid)
            return []
        rid = msg.rid if isinstance(msg.rid, str) else ""
        record(self.received, rid)
        sp = msg.sampling_params
        prompt = msg.input_ids or []
        if sp.n != 1 or (msg.return_logprob and not self.enable_logprobs):
            self._rejected.append((rid, len(prompt)))
            return []
        if msg.return_logprob:
            self._logprobs.add(rid)
        sched.add(
            MockRequest(
                rid=rid,
                prompt_ids=prompt,
                max_tokens=sp.max_new_tokens
                if sp.max_new_tokens is not None
                else DEFAULT_MAX_NEW_TOKENS,
                stop_token_ids=frozenset(sp.stop_token_ids or ()),
                ignore_eos=sp.ignore_eos,
                stream=msg.stream,
            )
        )
        return []

    def encode_step(
        self, outputs: list[StepOutput], aborted_queued: list[str], sched: MockScheduler
    ) -> list[list[bytes]]:
        if self._die:
            return [encode_engine_dead()]
        rows: list[OutputRow] = []
        for o in outputs:
            if o.finish is MockFinish.ABORT and o.rid in self._client_aborted:
                self._client_aborted.discard(o.rid)
                continue  # TokenSpeed never answers a client abort
            reason = "" if o.finish is None else o.finish.value
            lp = o.rid in self._logprobs
            rows.append(
                OutputRow(
                    rid=o.rid,
                    output_ids=o.new_ids,
                    finished_reason=reason,
                    prompt_tokens=o.prompt_tokens,
                    completion_tokens=o.completion_tokens,
                    cached_tokens=o.cached_tokens,
                    logprob_vals=[-0.5] * len(o.new_ids) if lp else [],
                    logprob_ids=list(o.new_ids) if lp else [],
                )
            )
            if o.finish is not None:
                self._logprobs.discard(o.rid)
        for rid, prompt_len in self._rejected:
            rows.append(
                OutputRow(rid=rid, output_ids=[], finished_reason="abort", prompt_tokens=prompt_len)
            )
        self._rejected.clear()
        self._client_aborted.difference_update(aborted_queued)
        self._logprobs.difference_update(aborted_queued)  # (they never finish in a step)
        if not rows:
            return []  # TokenSpeed never sends an empty batch
        return [
            encode_output(
                rows,
                engine_index=self.engine_index,
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
                kv_active_pages=len(sched.running),
                kv_total_pages=self.max_batch,
            )
        ]

    def garbage(self) -> list[bytes]:
        return [GARBAGE]
