"""The engine reader task: delivery of a large output message in slices, in order."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from smgd.engines.delivery import DELIVERY
from smgd.engines.reader import DELIVER_CHUNK, reader_task
from smgd.engines.sglang import SglangEngineClient
from smgd.engines.state import EngineState
from smgd.engines.stream import RequestStream
from smgd.errors import WireError
from smgd.wire.common import EngineInfo, Finish, FinishReason, TokenDelta, TokenLogprob
from tests.engine_harness import engine_config


class _Batches:
    """An output socket that hands out the given batches of messages, then parks until
    :meth:`add` gives it more."""

    def __init__(self, batches: list[list[list[Any]]]) -> None:
        self.batches = batches
        self._more = trio.Event()

    def add(self, batch: list[list[Any]]) -> None:
        self.batches.append(batch)
        self._more.set()

    async def recv_multipart_batch(self, limit: int) -> list[list[Any]]:
        await trio.lowlevel.checkpoint()
        while not self.batches:
            self._more = trio.Event()
            await self._more.wait()
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
        nursery.start_soon(reader_task, client)
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


async def _undecodable_then_good(bad: str, decode: Any) -> None:
    """A frame ``bad`` while r0 and r1 stream: both fail with a WireError (their output may
    have been in it, lost) and are aborted on the engine; r0's rows in the same batch are
    dropped; a request sent afterwards (r2) streams."""
    messages = _Batches([[[bad], [[TokenDelta(rid="r0", token_ids=[1])]]]])
    client = _client(messages)
    client.state = EngineState.READY
    got: list[tuple[str, list[int]]] = []
    _streams(client, 2, got)
    failed = dict(client._streams)
    client._decode_frames = decode  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader_task, client)
        with trio.fail_after(5):
            while not client._decode_errors:
                await trio.lowlevel.checkpoint()
            client._streams["r2"] = stream = RequestStream("r2", "e0")
            messages.add([[[TokenDelta(rid="r2", token_ids=[7])]]])
            while not stream._pending:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert got == []
    for rid, failed_stream in failed.items():
        with pytest.raises(WireError, match="could not decode") as caught:
            failed_stream.receive_nowait()
        assert "output may be incomplete" in caught.value.message
        assert client._outbox_recv.receive_nowait() == client._encode_abort(rid)
    with pytest.raises(trio.WouldBlock):
        client._outbox_recv.receive_nowait()
    delta = stream.receive_nowait()
    assert delta is not None and delta.token_ids == [7]
    assert list(client._streams) == ["r2"]
    assert client._decode_errors == 1
    assert client._decode_streak == 0
    assert client.state is EngineState.READY  # one bad frame is not a dead engine


def _decode_unless_bad(frames: list[Any]) -> list[TokenDelta]:
    """The test's decoder: a frame ``"bad"`` is undecodable, any other is its deltas."""
    if frames[0] == "bad":
        raise WireError("garbled")
    result: list[TokenDelta] = frames[0]
    return result


async def test_an_undecodable_frame_fails_the_streams_in_flight_and_the_reader_reads_on() -> None:
    await _undecodable_then_good("bad", _decode_unless_bad)


def _decode_or_trip(frames: list[Any]) -> list[TokenDelta]:
    """The test's decoder with a bug: a frame ``"trip"`` raises what Python raises."""
    if frames[0] == "trip":
        return [TokenDelta(rid="r0", token_ids=[int("not a number")])]
    result: list[TokenDelta] = frames[0]
    return result


async def test_a_decoder_that_trips_on_a_frame_counts_it_undecodable_and_reads_on() -> None:
    await _undecodable_then_good("trip", _decode_or_trip)


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
        nursery.start_soon(reader_task, client)
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
        nursery.start_soon(reader_task, client)
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


class _HeldWrites:
    """Sinks that write as a direct stream does: held while a delivery is open."""

    def __init__(self) -> None:
        self.delivered: list[str] = []  # rows, as the sinks got them
        self.written: list[str] = []  # their writes, as made
        self.written_before: list[int] = []  # writes made when each row reached its sink

    def install(self, client: SglangEngineClient, n: int) -> None:
        for i in range(n):
            stream = RequestStream(f"r{i}", "e0")
            stream.sink = self._sink
            client._streams[f"r{i}"] = stream

    def _sink(self, delta: TokenDelta) -> bool:
        self.delivered.append(delta.rid)
        self.written_before.append(len(self.written))
        if DELIVERY.open:
            DELIVERY.held.append(_HeldRow(self.written, delta.rid))
        else:
            self.written.append(delta.rid)
        return True


class _HeldRow:
    """One row's write, held as a direct writer holds it."""

    def __init__(self, written: list[str], rid: str) -> None:
        self.written, self.rid = written, rid

    def write_held(self) -> None:
        self.written.append(self.rid)


async def _watch_held_writes(
    client: SglangEngineClient, sinks: _HeldWrites, rows: int
) -> list[tuple[int, int, bool]]:
    """Run the reader until ``rows`` writes were made; return what another task saw each time
    it ran: (rows delivered, writes made, a delivery open or a write held)."""
    seen: list[tuple[int, int, bool]] = []

    async def other_task() -> None:
        while True:
            held = DELIVERY.open or bool(DELIVERY.held)
            seen.append((len(sinks.delivered), len(sinks.written), held))
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        nursery.start_soon(reader_task, client)
        with trio.fail_after(5):
            while len(sinks.written) < rows:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    return seen


class _SlowBatches(_Batches):
    """Batches that take three scheduler passes each to arrive: every other task runs at
    least once between two of them, whatever order trio runs a pass's tasks in."""

    async def recv_multipart_batch(self, limit: int) -> list[list[Any]]:
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
        return await super().recv_multipart_batch(limit)


async def test_a_messages_writes_are_held_to_the_end_of_its_delivery() -> None:
    rows = [TokenDelta(rid=f"r{i}", token_ids=[1]) for i in range(8)]
    client = _client(_SlowBatches([[[rows]], [[rows[:3]]]]))
    sinks = _HeldWrites()
    sinks.install(client, 8)
    seen = await _watch_held_writes(client, sinks, 11)
    assert sinks.written == sinks.delivered == [d.rid for d in rows + rows[:3]]
    assert sinks.written_before == [0] * 8 + [8] * 3  # each message's writes waited for it all
    # Whenever anything else ran, every delivered row was written and nothing was held.
    assert all(delivered == written and not held for delivered, written, held in seen)
    assert {delivered for delivered, _, _ in seen} >= {8}  # it ran between the two messages


async def test_writes_are_made_before_each_pass_inside_a_message_delivered_in_slices() -> None:
    n = 2 * DELIVER_CHUNK + 10
    rows = [TokenDelta(rid=f"r{i}", token_ids=[1]) for i in range(n)]
    client = _client(_messages(rows))
    sinks = _HeldWrites()
    sinks.install(client, n)
    seen = await _watch_held_writes(client, sinks, n)
    assert sinks.written == [d.rid for d in rows]
    assert [s for s in seen if 0 < s[0] < n]  # it ran between slices ...
    # ... with every write of the slices before made, and none held
    assert all(delivered == written and not held for delivered, written, held in seen)


async def test_a_reader_that_stops_on_undecodable_frames_still_makes_its_held_writes() -> None:
    good = [TokenDelta(rid="r0", token_ids=[1])]
    # A good message, then enough bad ones to end the reader, all in one batch.
    bad_streak = [["bad"]] * 100
    client = _client(_Batches([[[good], *bad_streak]]))
    sinks = _HeldWrites()
    sinks.install(client, 1)
    client._decode_frames = _decode_unless_bad  # type: ignore[method-assign]
    with trio.fail_after(5):
        await reader_task(client)  # returns: the engine was declared dead
    assert client._death is not None
    assert sinks.written == ["r0"]  # the row delivered before it stopped was written
    assert not DELIVERY.open and not DELIVERY.held


def _lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, logprob=-1.0)


def test_output_past_max_tokens_is_cut_there_and_a_runaway_request_aborted() -> None:
    client = _client(_Batches([]))
    client.state = EngineState.READY
    # Prompt of 2 tokens, max_tokens 3. The first request's engine finishes it, one token late.
    streams = {rid: RequestStream(rid, "e0", prompt_tokens=2, limit=5) for rid in ("done", "run")}
    client._streams.update(streams)
    client.deliver(TokenDelta(rid="done", token_ids=[1, 2], logprobs=[_lp(1), _lp(2)]))
    stop = Finish(reason=FinishReason.STOP, matched_token=9)
    late = TokenDelta(rid="done", token_ids=[3, 9], logprobs=[_lp(3), _lp(9)], finish=stop)
    late.completion_tokens = 4
    client.deliver(late)
    # The second one's engine ignores max_tokens: it would stream forever.
    client.deliver(TokenDelta(rid="run", token_ids=[1, 2, 3, 4]))
    client.deliver(TokenDelta(rid="run", token_ids=[5]))  # after the cut: dropped
    assert not client._streams
    done = streams["done"].receive_nowait()
    assert done is not None and done.token_ids == [1, 2, 3]
    assert [lp.token_id for lp in done.logprobs or ()] == [1, 2, 3]
    assert done.finish == Finish(reason=FinishReason.LENGTH)
    assert done.completion_tokens is None  # the engine's 4 counted the token cut
    run = streams["run"].receive_nowait()
    assert run is not None and run.token_ids == [1, 2, 3]
    assert run.finish == Finish(reason=FinishReason.LENGTH)
    assert all(s.tokens == 5 and s.finished for s in streams.values())
    # Only the request the engine had not finished is aborted there.
    assert client._outbox_recv.receive_nowait() == client._encode_abort("run")
    with pytest.raises(trio.WouldBlock):
        client._outbox_recv.receive_nowait()
