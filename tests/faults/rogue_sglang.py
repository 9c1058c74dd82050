"""A misbehaving SGLang scheduler for the fault suite: ``python rogue_sglang.py MODE IN OUT``.

It connects to smgd's request (``IN``) and output (``OUT``) ipc sockets exactly like a headless
scheduler (the mock's codec, so every well-formed frame is the real wire), reports itself
ready, answers health checks, and answers each generate request by ``MODE``:

- ``echo``: well-behaved; the prompt echoed until ``max_new_tokens``, then a length finish.
- ``ready-list``: well-behaved, but its ``SMGD_READY`` line holds a JSON array.
- ``no-ready-line``: well-behaved, but prints no ``SMGD_READY`` line.
- ``bad-top-logprob``: for a request with logprobs, first one output row whose top-logprob
  value is a string (a column the decoder's types do not pin down), then well-behaved.
- ``negative-id``: for a request with logprobs, first one output row whose token id (and its
  logprob's, and its top logprob's) is -1, then well-behaved.
- ``garble-fourth``: the frame with a request's fourth token is garbage (its token lost).
- ``exit-on-request``: on the first request after the health checks, closes its sockets and
  0.1 s later exits with code 3.
- ``chaos``: each output message also holds 10,000 rows for rids smgd never sent, and after
  the finish come more tokens and the finish again, in the same message.
- ``nan-embedding`` / ``huge-embedding`` (an embedding engine: ``task = "embed"``): each
  vector holds a NaN / 1e300 (no float32); health checks get a clean one.
- ``runaway``: ignores ``max_new_tokens``: streams tokens and never finishes.
- ``lose-13``: never answers a request with ``max_new_tokens = 13`` (it loses it); answers
  every other request well.
- ``flood``: well-behaved, but from its start two threads write short lines to its stdout and
  its stderr as fast as the pipes take them (the ready line goes out in the middle of it).
- ``huge-frame``: answers its first request with one output message of ``HUGE_FRAME_BYTES``
  (its first token, and a row for a request smgd never sent whose text is that long), then
  well-behaved.

Launched by smgd (``[engines.launch] kind = "command"``), so it dies with the daemon.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from smgd.mock.engine import GARBAGE
from smgd.wire.common import Finish, FinishReason, TokenLogprob, TopLogprob
from smgd.wire.sglang.arrays import ext_to_ids
from smgd.wire.sglang.decode import decode_request
from smgd.wire.sglang.engine_side import (
    EmbeddingItem,
    build_batch_output,
    encode_batch_output,
    encode_embedding_output,
)
from smgd.wire.sglang.structs import (
    AbortReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)

STEP_S = 0.005  # between two output frames of one request
CHAOS_ROWS = 10_000  # rows for requests smgd never sent, in each ``chaos`` message
LOST_LIMIT = 13  # ``lose-13``: the max_new_tokens of the requests it never answers
# ``huge-frame``'s message: over the 1 MiB limit the fault case sets, far under smgd's default.
HUGE_FRAME_BYTES = 4 << 20


def flood(fd: int, name: str) -> None:
    """Write short lines to ``fd`` for ever, in blocks of at most PIPE_BUF (4,096) bytes: a
    pipe write that size is atomic, so the ready line never lands inside a flood line. The
    block is made once: the thread spends its time in the write, which releases the GIL (the
    engine's own thread goes on answering)."""
    block = "".join(f"{name} flood line {k}\n" for k in range(128)).encode()
    assert len(block) <= 4096
    while True:
        os.write(fd, block)


def main() -> None:
    mode, input_addr, output_addr = sys.argv[1:4]
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(input_addr)
    push.connect(output_addr)
    if mode == "flood":
        for fd, name in ((1, "stdout"), (2, "stderr")):
            threading.Thread(target=flood, args=(fd, name), daemon=True).start()
        time.sleep(0.2)  # the flood is under way before the ready line
    # ``ready-list``: a well-behaved engine whose ready line is JSON but not an object.
    if mode != "no-ready-line":
        report = "[4096]" if mode == "ready-list" else '{"context_length": 4096}'
        os.write(1, f"SMGD_READY {report}\n".encode())  # one write: atomic beside a flood
    huge_sent = False
    aborted: set[str] = set()
    pending: list[bytes] = []  # requests that came while another was being answered
    while True:
        msg = decode_request(pending.pop(0) if pending else pull.recv())
        if isinstance(msg, AbortReq):
            aborted.add(msg.rid or "")
            print(f"rogue: abort {msg.rid}", flush=True)
            continue
        if isinstance(msg, TokenizedEmbeddingReqInput):
            erid = msg.rid or ""
            vector = [0.5] * 8
            if not erid.startswith("HEALTH_CHECK"):
                vector[3] = {"nan-embedding": math.nan, "huge-embedding": 1e300}.get(mode, 0.5)
            done = Finish(reason=FinishReason.LENGTH)
            push.send(encode_embedding_output([EmbeddingItem(erid, vector, done, 2, 0)]))
            continue
        if not isinstance(msg, TokenizedGenerateReqInput):
            continue
        rid = msg.rid or ""
        prompt = ext_to_ids(msg.input_ids)
        limit = msg.sampling_params.max_new_tokens or 16
        if rid.startswith("HEALTH_CHECK"):
            length = Finish(reason=FinishReason.LENGTH)
            push.send(encode_batch_output([(rid, [1], length, 1, 1, 0)]))
            continue
        if mode == "lose-13" and limit == LOST_LIMIT:
            print(f"rogue: lost {rid}", flush=True)
            continue
        if mode == "exit-on-request":
            # As a crashing scheduler: its sockets go first, the process a moment later.
            pull.close()
            push.close()
            time.sleep(0.1)
            sys.exit(3)
        if mode == "bad-top-logprob" and msg.return_logprob:
            row = TokenLogprob(token_id=prompt[0], logprob=-0.5, top=[TopLogprob(prompt[0], -0.5)])
            out = build_batch_output([(rid, [prompt[0]], None, len(prompt), 1, 0, [row])])
            out = msgspec.structs.replace(out, output_top_logprobs_val=[[["not a number"]]])
            push.send(msgspec.msgpack.encode(out))
        if mode == "negative-id" and msg.return_logprob:
            row = TokenLogprob(token_id=-1, logprob=-0.5, top=[TopLogprob(-1, -0.5)])
            push.send(encode_batch_output([(rid, [-1], None, len(prompt), 1, 0, [row])]))
        # Tokens sent so far: that row is one (of max_new_tokens) unless undecodable.
        n = 1 if mode == "negative-id" and msg.return_logprob else 0
        if mode == "huge-frame" and not huge_sent:
            huge_sent = True
            out = build_batch_output(
                [(rid, [prompt[0]], None, len(prompt), 1, 0), (f"{rid}-x", [1], None, 1, 1, 0)]
            )
            out = msgspec.structs.replace(out, decoded_texts=["", "x" * HUGE_FRAME_BYTES])
            push.send(msgspec.msgpack.encode(out))
            n = 1
        while mode == "runaway" or n < limit:
            if rid in aborted:
                break
            tid = prompt[n % len(prompt)]
            n += 1
            last = mode != "runaway" and n == limit
            finish = Finish(reason=FinishReason.LENGTH) if last else None
            if mode == "garble-fourth" and n == 4:
                push.send(GARBAGE)
            elif mode == "chaos":
                rows: list[tuple[Any, ...]] = [
                    (f"nobody-{k}", [tid], None, 3, n, 0) for k in range(CHAOS_ROWS)
                ]
                rows.insert(CHAOS_ROWS // 2, (rid, [tid], finish, len(prompt), n, 0))
                if last:  # tokens after the finish, and the finish again
                    rows.append((rid, [tid, tid, tid], None, len(prompt), n + 3, 0))
                    rows.append((rid, [tid], finish, len(prompt), n + 4, 0))
                push.send(encode_batch_output(rows))
            else:
                push.send(encode_batch_output([(rid, [tid], finish, len(prompt), n, 0)]))
            time.sleep(STEP_S)
            while pull.poll(0):  # an abort for this request, or a later request (kept)
                frame = pull.recv()
                later = decode_request(frame)
                if isinstance(later, AbortReq):
                    aborted.add(later.rid or "")
                    print(f"rogue: abort {later.rid}", flush=True)
                else:
                    pending.append(frame)


if __name__ == "__main__":
    main()
