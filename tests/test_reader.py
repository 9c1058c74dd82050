"""The engine reader task: delivery of a large output message in slices, in order."""

from __future__ import annotations

from typing import Any

import trio

from smgd.engines.base import DELIVER_CHUNK
from smgd.engines.sglang import SglangEngineClient
from smgd.engines.stream import RequestStream
from smgd.wire.common import EngineInfo, Finish, FinishReason, TokenDelta
from tests.engine_harness import engine_config


class _Batches:
    """An output socket that hands out the given batches of messages, then parks."""

    def __init__(self, batches: list[list[list[Any]]]) -> None:
        self.batches = batches

    async def recv_multipart_batch(self, limit: int) -> list[list[Any]]:
        await trio.lowlevel.checkpoint()
        if not self.batches:
            await trio.sleep_forever()
        return self.batches.pop(0)


def _messages(*messages: list[TokenDelta]) -> _Batches:
    """One batch per message, each message one frame: its deltas, already decoded."""
    return _Batches([[[message]] for message in messages])


def _client(messages: _Batches) -> SglangEngineClient:
    client = SglangEngineClient(
        engine_config(),
        fallback_info=EngineInfo(max_model_len=4096, vocab_size=1024),
        input_path="/nonexistent/in.sock",
        output_path="/nonexistent/out.sock",
    )
    # The reader's two seams: its socket, and the message's deltas (already decoded here).
    client._output_socket = lambda: messages  # type: ignore[assignment,method-assign,return-value]
    client._decode_frames = lambda frames: frames[0]  # type: ignore[method-assign]
    return client


def _streams(client: SglangEngineClient, n: int, got: list[tuple[str, list[int]]]) -> None:
    def sink(delta: TokenDelta) -> bool:
        got.append((delta.rid, delta.token_ids))
        return True

    for i in range(n):
        stream = RequestStream(f"r{i}", "e0")
        stream.sink = sink
        client._streams[f"r{i}"] = stream


async def test_a_large_message_is_delivered_in_slices_with_passes_between() -> None:
    n = 2 * DELIVER_CHUNK + 10
    large = [TokenDelta(rid=f"r{i}", token_ids=[1]) for i in range(n)]
    small = [TokenDelta(rid=f"r{i}", token_ids=[2]) for i in range(DELIVER_CHUNK)]
    last = [
        TokenDelta(rid=f"r{i}", token_ids=[3], finish=Finish(reason=FinishReason.LENGTH))
        for i in range(n)
    ]
    client = _client(_messages(large, small, last))
    got: list[tuple[str, list[int]]] = []
    _streams(client, n, got)
    seen: list[int] = []  # what another task saw each time it ran

    async def other_task() -> None:
        while True:
            seen.append(len(got))
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        nursery.start_soon(client._reader_task)
        with trio.fail_after(5):
            while len(got) < 2 * n + DELIVER_CHUNK:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()

    # Every row once, in each message's order, the messages in order.
    assert got == [(d.rid, d.token_ids) for d in large + small + last]
    assert not client._streams  # the finishes removed every stream
    # Other tasks ran inside each large message, between two slices (trio runs a pass's tasks
    # in random order, so which slice boundaries they saw varies; that they saw one does not)
    first = {k for k in seen if 0 < k < n}
    assert first and first <= {DELIVER_CHUNK, 2 * DELIVER_CHUNK}
    third = {k - n - DELIVER_CHUNK for k in seen if n + DELIVER_CHUNK < k < 2 * n + DELIVER_CHUNK}
    assert third and third <= {DELIVER_CHUNK, 2 * DELIVER_CHUNK}
    # ... and never inside a message of at most DELIVER_CHUNK rows.
    assert not {k for k in seen if n < k < n + DELIVER_CHUNK}


async def test_a_decode_error_skips_its_message_and_the_rest_of_the_batch_is_delivered() -> None:
    from smgd.errors import WireError

    good = [TokenDelta(rid="r0", token_ids=[1])]
    client = _client(_Batches([[["bad"], [good]]]))
    got: list[tuple[str, list[int]]] = []
    _streams(client, 1, got)

    def decode(frames: list[Any]) -> list[TokenDelta]:
        if frames[0] == "bad":
            raise WireError("garbled")
        result: list[TokenDelta] = frames[0]
        return result

    client._decode_frames = decode  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client._reader_task)
        with trio.fail_after(5):
            while not got:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert got == [("r0", [1])]
    assert client._decode_errors == 1
    assert client._decode_streak == 0


async def test_first_outputs_go_first_in_a_message_delivered_in_slices() -> None:
    n = 2 * DELIVER_CHUNK + 10
    # As an engine orders a step: the running requests, then the ones it just admitted.
    large = [TokenDelta(rid=f"r{i}", token_ids=[1]) for i in range(n)]
    small = [TokenDelta(rid=f"r{i}", token_ids=[2]) for i in range(n - 3, n)]
    client = _client(_messages(large, small))
    got: list[tuple[str, list[int]]] = []
    _streams(client, n, got)
    new = [f"r{i}" for i in range(n - 5, n)]
    client._fresh.update(new)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client._reader_task)
        with trio.fail_after(5):
            while len(got) < n + len(small):
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    first = [(d.rid, d.token_ids) for d in large if d.rid in new]
    rest = [(d.rid, d.token_ids) for d in large if d.rid not in new]
    assert got == first + rest + [(d.rid, d.token_ids) for d in small]
    assert not client._fresh  # they have had output now


async def test_a_small_message_keeps_the_engines_order() -> None:
    rows = [TokenDelta(rid=f"r{i}", token_ids=[1]) for i in range(DELIVER_CHUNK)]
    client = _client(_messages(rows))
    got: list[tuple[str, list[int]]] = []
    _streams(client, DELIVER_CHUNK, got)
    client._fresh.add(f"r{DELIVER_CHUNK - 1}")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client._reader_task)
        with trio.fail_after(5):
            while len(got) < DELIVER_CHUNK:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert got == [(d.rid, d.token_ids) for d in rows]


async def test_a_request_is_fresh_from_its_send_until_its_stream_closes() -> None:
    from tests.engine_harness import collect, request, sglang_pair

    async with sglang_pair() as pair:
        client = pair.client
        req = request("fresh-1", [5, 6, 7], max_tokens=3)
        async with client.open_stream(req):
            assert "fresh-1" in client._fresh
        assert "fresh-1" not in client._fresh  # left before any output: closed, forgotten
        ids, _ = await collect(client, request("fresh-2", [5, 6, 7], max_tokens=3))
        assert len(ids) == 3
        assert not client._fresh
