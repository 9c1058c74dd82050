"""The mock engine on SGLang's scheduler wire: it connects exactly like a headless scheduler.

Scheduler side of the topology: PULL connects to smgd's request socket, PUSH connects to smgd's
output socket. Requests are decoded and outputs encoded with smgd's own SGLang codec, which is
byte-checked against SGLang's encoder, so the mock speaks the real wire.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import zmq

from smgd.mock.engine import GARBAGE, EngineExit
from smgd.mock.scheduler import MockFinish, MockRequest, MockScheduler, StepOutput
from smgd.wire.common import Finish, FinishReason
from smgd.wire.sglang.arrays import ext_to_ids
from smgd.wire.sglang.decode import decode_request
from smgd.wire.sglang.engine_side import (
    EmbeddingItem,
    encode_abort_echo,
    encode_batch_output,
    encode_embedding_output,
    encode_flush_output,
)
from smgd.wire.sglang.structs import (
    AbortReq,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FlushCacheReqInput,
    ShutdownReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from smgd.zmq_trio import TrioSocket

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("smgd.mock")

# The most of a constraint the mock logs (see SglangMockWire._add).
CONSTRAINT_LOG_CHARS = 4096

_FINISH = {
    MockFinish.LENGTH: FinishReason.LENGTH,
    MockFinish.STOP: FinishReason.STOP,
    MockFinish.ABORT: FinishReason.ABORT,
    MockFinish.EMBEDDED: FinishReason.LENGTH,  # SGLang finishes an embedding by length
}


class SglangMockWire:
    def __init__(self, input_addr: str, output_addr: str) -> None:
        self.input_addr = input_addr
        self.output_addr = output_addr

    async def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[TrioSocket, TrioSocket]:
        pull = ctx.socket(zmq.PULL)
        push = ctx.socket(zmq.PUSH)
        for sock in (pull, push):
            sock.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, 0)
        push.setsockopt(zmq.SNDHWM, 0)
        pull.connect(self.input_addr)
        push.connect(self.output_addr)
        return TrioSocket(pull), TrioSocket(push)

    def on_request(self, frames: Sequence[bytes], sched: MockScheduler) -> list[list[bytes]]:
        msg = decode_request(frames[0])
        if isinstance(msg, TokenizedGenerateReqInput):
            self._add(msg, sched)
        elif isinstance(msg, BatchTokenizedGenerateReqInput):
            for item in msg.batch:
                self._add(item, sched)
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            self._add_embedding(msg, sched)
        elif isinstance(msg, BatchTokenizedEmbeddingReqInput):
            for one in msg.batch:
                self._add_embedding(one, sched)
        elif isinstance(msg, AbortReq):
            # Logged: an abort is what a client cannot see, and the fault suite checks for it.
            log.info("abort %s", "all" if msg.abort_all else msg.rid)
            sched.abort("" if msg.abort_all else (msg.rid or ""))
        elif isinstance(msg, FlushCacheReqInput):
            return [[encode_flush_output(True)]]
        elif isinstance(msg, ShutdownReq):
            raise EngineExit(0)
        return []

    @staticmethod
    def _add(msg: TokenizedGenerateReqInput, sched: MockScheduler) -> None:
        sp = msg.sampling_params
        ids = ext_to_ids(msg.input_ids)
        for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
            constraint: str | None = getattr(sp, kind)
            if constraint is not None:
                # Logged: the mock writes its echo or script whatever the constraint (it has
                # no grammar), so the line is what shows which constraint reached the engine.
                # A big one (the fault suite sends 8 MB schemas) only by its start and size.
                if len(constraint) > CONSTRAINT_LOG_CHARS:
                    size = len(constraint)
                    constraint = f"{constraint[:CONSTRAINT_LOG_CHARS]}... ({size} characters)"
                log.info("constraint %s %s: %s", msg.rid, kind, constraint)
        sched.add(
            MockRequest(
                rid=msg.rid or "",
                prompt_ids=ids,
                max_tokens=sp.max_new_tokens if sp.max_new_tokens is not None else 128,
                stop_token_ids=frozenset(sp.stop_token_ids or ()),
                ignore_eos=sp.ignore_eos,
                stream=msg.stream,
                logprobs=msg.top_logprobs_num if msg.return_logprob else None,
                prompt_logprobs=(
                    msg.top_logprobs_num
                    if msg.return_logprob and msg.logprob_start_len == 0
                    else None
                ),
                min_tokens=sp.min_new_tokens,
                priority=msg.priority or 0,
                lora=msg.lora_name if msg.lora_id is not None else None,
            )
        )

    @staticmethod
    def _add_embedding(msg: TokenizedEmbeddingReqInput, sched: MockScheduler) -> None:
        ids = ext_to_ids(msg.input_ids)
        sched.add(
            MockRequest(
                rid=msg.rid or "",
                prompt_ids=ids,
                max_tokens=0,
                embed=True,
                dimensions=msg.dimensions,
            )
        )

    def encode_step(
        self, outputs: list[StepOutput], aborted_queued: list[str], sched: MockScheduler
    ) -> list[list[bytes]]:
        messages: list[list[bytes]] = []
        embedded = [o for o in outputs if o.embedding is not None]
        if embedded:
            outputs = [o for o in outputs if o.embedding is None]
            items = [
                EmbeddingItem(
                    o.rid,
                    o.embedding,
                    Finish(reason=FinishReason.LENGTH),
                    o.prompt_tokens,
                    o.cached_tokens,
                )
                for o in embedded
            ]
            messages.append([encode_embedding_output(items)])
        if outputs:
            rows = [
                (
                    o.rid,
                    o.new_ids,
                    _finish(o),
                    o.prompt_tokens,
                    o.completion_tokens,
                    o.cached_tokens,
                    o.logprobs,
                    None if o.prompt_logprobs is None else (o.prompt_first, o.prompt_logprobs),
                )
                for o in outputs
            ]
            messages.append([encode_batch_output(rows)])
        for rid in aborted_queued:
            finish = Finish(reason=FinishReason.ABORT, message="Aborted")
            messages.append([encode_abort_echo(rid, finish)])
        return messages

    def garbage(self) -> list[bytes]:
        return [GARBAGE]


def _finish(o: StepOutput) -> Finish | None:
    if o.finish is None:
        return None
    if o.finish is MockFinish.ABORT:
        return Finish(reason=FinishReason.ABORT, message="Aborted")
    return Finish(reason=_FINISH[o.finish], matched_token=o.matched)
