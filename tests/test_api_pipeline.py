"""Pure tests of the per-request state: finish reasons, stops, usage, request ids."""

from __future__ import annotations

import logging
from array import array

import pytest

from smgd.api.core.pipeline import (
    Choice,
    RequestState,
    check_request_id,
    new_engine_rid,
    new_request_id,
)
from smgd.errors import EngineDead, EngineRejected, InvalidRequest
from smgd.text.stream import TextStream
from smgd.text.tokenizer import load_tokenizer
from smgd.wire.common import Finish, FinishReason, TokenDelta
from tests.fake_engine import TINY_MODEL

TOK = load_tokenizer(TINY_MODEL)
IDS = TOK.encode(" Hello, world! How are you today?", add_special_tokens=False)


def choice(stops: tuple[str, ...] = (), **kw: object) -> Choice:
    return Choice(0, "r", TextStream(TOK, stops=stops), prompt_tokens=5, **kw)  # type: ignore[arg-type]


def delta(
    ids: list[int],
    finish: Finish | None = None,
    *,
    completion_tokens: int | None = None,
    cached_tokens: int | None = None,
) -> TokenDelta:
    return TokenDelta(
        rid="r",
        token_ids=list(ids),
        finish=finish,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )


def test_stop_string_split_across_deltas_is_caught() -> None:
    c = choice(stops=("world",))
    out = [c.apply(delta([i])) for i in IDS[:6]]
    assert "".join(out) == " Hello, "
    assert c.finish_reason == "stop"
    assert c.matched == "world"
    assert c.stopped_here  # the engine is still running: the caller aborts it
    assert c.apply(delta([IDS[6]])) == ""  # later output is ignored


@pytest.mark.parametrize("finish", [None, Finish(reason=FinishReason.LENGTH)])
def test_stop_in_a_merged_delta_counts_through_the_completing_token(
    finish: Finish | None,
) -> None:
    # One delta holds the whole output (coalesced for a slow reader, or a non-streamed
    # request's batch), the engine counted all of it, maybe finished: only the ids up to
    # the one completing the stop count, whatever the grouping.
    c = choice(stops=("world",), keep_ids=True)
    done = next(i for i in range(len(IDS)) if "world" in TOK.decode(IDS[: i + 1]))
    assert done < len(IDS) - 2
    text = c.apply(delta(IDS[:2], completion_tokens=2))
    text += c.apply(delta(IDS[2:], finish, completion_tokens=100))
    assert text == " Hello, "
    assert (c.finish_reason, c.matched) == ("stop", "world")
    assert c.completion_tokens == done + 1
    assert c.output_ids == IDS[: done + 1]
    assert c.stopped_here == (finish is None)  # a finished engine request needs no abort


def test_eos_text_is_not_emitted_and_counts() -> None:
    c = choice()
    text = c.apply(delta([*IDS[:3], 2], Finish(reason=FinishReason.STOP, matched_token=2)))
    assert text == TOK.decode(IDS[:3])
    assert (c.finish_reason, c.matched, c.completion_tokens) == ("stop", 2, 4)
    assert not c.stopped_here


def test_non_special_stop_token_text_is_dropped() -> None:
    c = choice()
    text = c.apply(delta(IDS[:4], Finish(reason=FinishReason.STOP, matched_token=IDS[3])))
    assert text == TOK.decode(IDS[:3])


def test_length_flushes_held_text() -> None:
    c = choice(stops=("zzzz",))
    text = c.apply(delta(IDS[:3], Finish(reason=FinishReason.LENGTH)))
    assert text == TOK.decode(IDS[:3])
    assert c.finish_reason == "length"


@pytest.mark.parametrize(
    ("finish", "error"),
    [
        (Finish(reason=FinishReason.ABORT, message="too long", status_code=400), EngineRejected),
        (Finish(reason=FinishReason.ABORT), EngineRejected),
        (Finish(reason=FinishReason.ERROR, message="oom"), EngineDead),
        (Finish(reason=FinishReason.ABORT, status_code=503), EngineDead),
    ],
)
def test_engine_side_abort_is_an_error(finish: Finish, error: type[Exception]) -> None:
    with pytest.raises(error):
        choice().apply(delta([], finish))


def test_usage_counts_shared_prompt_once_and_cached() -> None:
    state = RequestState(request_id="x", kind="chat", model="m", created=0, t_start=0.0)
    a = choice()
    b = Choice(1, "r2", TextStream(TOK), prompt_tokens=5, counts_prompt=False)
    state.choices += [a, b]
    a.apply(delta(IDS[:2], cached_tokens=4))
    b.apply(delta(IDS[:3]))
    assert state.usage() == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    state.first_output(0.25)
    fields = state.log_fields(1.0)
    assert fields["ttft_ms"] == 250.0
    assert fields["e2e_ms"] == 1000.0
    assert fields["engine_rids"] == ["r", "r2"]


def test_a_request_left_unfinished_without_an_error_is_its_clients_disconnect() -> None:
    state = RequestState(request_id="x", kind="completion", model="m", created=0, t_start=0.0)
    done, running = choice(), choice()
    state.choices += [done, running]
    done.apply(delta(IDS[:2], Finish(reason=FinishReason.LENGTH)))
    running.apply(delta(IDS[:2]))
    assert state.log_fields(1.0)["client_disconnected"] is True  # a choice was cut off
    running.apply(delta(IDS[2:3], Finish(reason=FinishReason.LENGTH)))
    assert state.log_fields(1.0)["client_disconnected"] is False  # every choice finished
    failed = RequestState(request_id="y", kind="completion", model="m", created=0, t_start=0.0)
    failed.choices.append(choice())
    failed.fail(EngineDead("gone"))
    assert failed.log_fields(1.0)["client_disconnected"] is False  # an error ended it


def test_engine_reported_count_wins_when_larger() -> None:
    c = choice()
    c.apply(delta(IDS[:2], completion_tokens=3))
    assert c.completion_tokens == 3


def test_request_ids() -> None:
    assert check_request_id("abc-1.2:x", "X-Request-Id") == "abc-1.2:x"
    for bad in ("", "a b", "x" * 129, "é"):
        with pytest.raises(InvalidRequest):
            check_request_id(bad, "X-Request-Id")
    for new_id in (new_engine_rid, new_request_id):
        ids = {new_id() for _ in range(1000)}
        assert len(ids) == 1000
        # Fixed-length hex: no engine rid is a prefix of another (SGLang aborts by prefix).
        assert {len(r) for r in ids} == {32}
        assert all(int(r, 16) >= 0 for r in ids)
        assert any(r.startswith("0") for r in ids)  # leading zeros are kept


async def test_the_log_line_of_a_request_is_built_only_when_it_is_written(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from smgd.api.core.execute import log_request

    built: list[float] = []
    real = RequestState.log_fields

    def counting(self: RequestState, now: float) -> dict[str, object]:
        built.append(now)
        return real(self, now)

    monkeypatch.setattr(RequestState, "log_fields", counting)
    state = RequestState(request_id="x", kind="completions", model="m", created=0, t_start=0.0)
    state.choices.append(choice())
    with caplog.at_level(logging.WARNING, logger="smgd.api"):
        log_request(state)  # an info line nobody writes
    assert built == [] and state.t_end is not None
    with caplog.at_level(logging.INFO, logger="smgd.api"):
        log_request(state)
    assert len(built) == 1 and "x completions done" in caplog.text


def test_output_events_keep_times_and_gaps() -> None:
    state = RequestState(request_id="x", kind="completions", model="m", created=0, t_start=0.0)
    c = choice()
    state.choices.append(c)
    state.output_event(c, 0.5)  # nothing applied yet: not an output event
    assert (c.t_first, state.t_first) == (None, None)
    c.apply(delta(IDS[:1]))
    state.output_event(c, 1.0)
    c.apply(delta(IDS[1:3]))
    state.output_event(c, 1.25)
    state.output_event(c, 1.5)  # the same tokens again: no event
    c.apply(delta(IDS[3:4]))
    assert c.output_event(2.0, state.gaps) is False  # a stream's own call, not the first
    assert (c.t_first, c.t_last, state.t_first) == (1.0, 2.0, 1.0)
    assert list(state.gaps) == [0.25, 0.75]


def test_a_choices_first_output_event_says_so() -> None:
    c = choice()
    gaps = array("d")
    c.apply(delta(IDS[:1]))
    assert c.output_event(3.0, gaps) is True
    assert c.t_first == c.t_last == 3.0 and not gaps
