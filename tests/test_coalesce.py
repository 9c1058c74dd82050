"""``coalesce``: several engine messages' deltas, one per request, nothing lost or reordered."""

from __future__ import annotations

from smgd.wire.common import Finish, FinishReason, TokenDelta, TokenLogprob, coalesce


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token_id=token, logprob=-float(token))


def test_one_message_comes_back_as_it_was() -> None:
    rows = [TokenDelta(rid="a", token_ids=[1]), TokenDelta(rid="b", token_ids=[2])]
    assert coalesce([list(rows)]) == rows


def test_each_request_keeps_its_first_place_and_its_tokens_in_order() -> None:
    got = coalesce(
        [
            [TokenDelta(rid="a", token_ids=[1]), TokenDelta(rid="b", token_ids=[2])],
            [TokenDelta(rid="c", token_ids=[3]), TokenDelta(rid="a", token_ids=[4, 5])],
            [TokenDelta(rid="b", token_ids=[]), TokenDelta(rid="a", token_ids=[6])],
        ]
    )
    assert [(d.rid, d.token_ids) for d in got] == [("a", [1, 4, 5, 6]), ("b", [2]), ("c", [3])]


def test_logprobs_usage_and_finish_are_folded_in() -> None:
    done = Finish(reason=FinishReason.STOP, matched_text="x")
    first = TokenDelta(
        rid="a", token_ids=[1], logprobs=[_lp(1)], prompt_tokens=4, completion_tokens=1
    )
    last = TokenDelta(
        rid="a", token_ids=[2], logprobs=[_lp(2)], finish=done, completion_tokens=2,
        cached_tokens=3,
    )  # fmt: skip
    (got,) = coalesce([[first], [last]])
    assert got.token_ids == [1, 2]
    assert got.logprobs == [_lp(1), _lp(2)]
    assert got.finish == done
    assert (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (4, 2, 3)


def test_a_message_with_no_rows_changes_nothing() -> None:
    rows = [TokenDelta(rid="a", token_ids=[1])]
    assert coalesce([[], rows, []]) == rows
