"""RequestStream: coalescing, one consumer, failure, end of stream."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from smgd.engines.stream import RequestStream, fail_all
from smgd.errors import EngineDead
from smgd.wire.common import Finish, FinishReason, TokenDelta


def delta(
    ids: list[int], finish: FinishReason | None = None, done: int | None = None
) -> TokenDelta:
    return TokenDelta(
        rid="r",
        token_ids=ids,
        finish=Finish(reason=finish) if finish else None,
        completion_tokens=done,
    )


async def test_lagging_consumer_gets_everything_merged() -> None:
    stream = RequestStream("r", "e")
    stream.push(delta([1], done=1))
    stream.push(delta([2, 3], done=3))
    stream.push(delta([4], FinishReason.LENGTH, done=4))
    got = await stream.receive()
    assert got.token_ids == [1, 2, 3, 4]
    assert got.completion_tokens == 4
    assert got.finish is not None and got.finish.reason is FinishReason.LENGTH
    with pytest.raises(trio.EndOfChannel):
        await stream.receive()


async def test_waiting_consumer_is_woken_per_push() -> None:
    stream = RequestStream("r", "e")
    seen: list[list[int]] = []

    async def consumer() -> None:
        async for d in stream:
            seen.append(d.token_ids)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        stream.push(delta([1]))
        await trio.testing.wait_all_tasks_blocked()
        stream.push(delta([2], FinishReason.STOP))
    assert seen == [[1], [2]]


async def test_failure_reaches_consumer_after_pending_output() -> None:
    stream = RequestStream("r", "e")
    stream.push(delta([1]))
    streams = {"r": stream}
    assert fail_all(streams, EngineDead("boom")) == 1
    assert streams == {}
    assert (await stream.receive()).token_ids == [1]
    with pytest.raises(EngineDead, match="boom"):
        await stream.receive()


async def test_second_receiver_is_an_error() -> None:
    stream = RequestStream("r", "e")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.receive)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await stream.receive()
        stream.push(delta([1], FinishReason.STOP))


async def test_push_after_finish_is_ignored() -> None:
    stream = RequestStream("r", "e")
    stream.push(delta([1], FinishReason.STOP))
    stream.push(delta([9]))
    assert (await stream.receive()).token_ids == [1]


async def test_a_cancelled_receive_never_loses_output() -> None:
    stream = RequestStream("r", "e")
    received: list[int] = []
    for i in range(200):
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled before and during every receive
            stream.push(delta([i]))
            try:
                got = await stream.receive()
            except trio.Cancelled:
                pass
            else:
                received.extend(got.token_ids)
    stream.push(delta([], FinishReason.STOP))
    async for got in stream:
        received.extend(got.token_ids)
    assert received == list(range(200))
