"""RequestStream: coalescing, one consumer, failure, end of stream."""

from __future__ import annotations

import traceback
from functools import partial

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
    assert fail_all(streams, partial(EngineDead, "boom")) == 1
    assert streams == {}
    assert (await stream.receive()).token_ids == [1]
    with pytest.raises(EngineDead, match="boom"):
        await stream.receive()


async def _error_of(stream: RequestStream) -> BaseException:
    """What one consumer's receive raises (the pending output drained first)."""
    try:
        while True:
            await stream.receive()
    except EngineDead as exc:
        return exc
    raise AssertionError("the stream did not fail")


async def test_every_failed_stream_gets_its_own_error_object() -> None:
    streams = {rid: RequestStream(rid, "e") for rid in ("a", "b")}
    for stream in streams.values():
        stream.push(delta([1]))
    views = list(streams.values())
    assert fail_all(streams, partial(EngineDead, "engine e failed: gone")) == 2
    first, second = [await _error_of(s) for s in views]
    assert first is not second
    assert str(first) == str(second) == "engine e failed: gone"


async def _traceback_lengths(count: int) -> set[int]:
    """Traceback lengths of the errors ``count`` consumers of failed streams catch."""
    streams = {str(i): RequestStream(str(i), "e") for i in range(count)}
    views = list(streams.values())
    fail_all(streams, partial(EngineDead, "boom"))
    errors: list[BaseException] = []

    async def consume(stream: RequestStream) -> None:
        errors.append(await _error_of(stream))

    async with trio.open_nursery() as nursery:
        for stream in views:
            nursery.start_soon(consume, stream)
    assert len(errors) == count
    return {len(traceback.extract_tb(e.__traceback__)) for e in errors}


async def test_a_failed_streams_traceback_does_not_grow_with_other_streams() -> None:
    # Each consumer's error holds its own raise only: as long with 50 streams as with 1.
    alone = await _traceback_lengths(1)
    assert await _traceback_lengths(50) == alone
    assert len(alone) == 1 and min(alone) <= 3  # _error_of -> receive -> receive_nowait


async def test_receiving_again_from_a_failed_stream_does_not_grow_its_traceback() -> None:
    stream = RequestStream("r", "e")
    fail_all({"r": stream}, partial(EngineDead, "boom"))
    lengths = []
    for _ in range(3):
        with pytest.raises(EngineDead) as info:
            stream.receive_nowait()
        lengths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert lengths[0] == lengths[1] == lengths[2]


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
