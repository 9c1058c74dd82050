"""The sans-IO mock scheduler: batching, limits, stops, aborts."""

from __future__ import annotations

from smgd.mock.scheduler import MockFinish, MockRequest, MockScheduler


def run_to_end(sched: MockScheduler, limit: int = 10_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(limit):
        if sched.idle:
            break
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_ids)
    return out


def test_echoes_prompt_skipping_specials_until_length() -> None:
    sched = MockScheduler(max_batch=4, eos_ids=[2], skip_ids=[1])
    sched.add(MockRequest(rid="a", prompt_ids=[1, 10, 11, 12], max_tokens=7))
    assert run_to_end(sched)["a"] == [10, 11, 12, 10, 11, 12, 10]


def test_batch_cap_queues_the_rest() -> None:
    sched = MockScheduler(max_batch=2)
    for rid in "abc":
        sched.add(MockRequest(rid=rid, prompt_ids=[5], max_tokens=3))
    first = sched.step()
    assert sorted(o.rid for o in first) == ["a", "b"]
    out = run_to_end(sched)
    assert len(out["c"]) == 3


def test_stop_token_and_finish_reason() -> None:
    sched = MockScheduler(max_batch=1)
    sched.add(
        MockRequest(rid="a", prompt_ids=[7, 8, 9], max_tokens=10, stop_token_ids=frozenset({9}))
    )
    outs = [o for _ in range(5) for o in sched.step()]
    assert [t for o in outs for t in o.new_ids] == [7, 8, 9]
    assert outs[-1].finish is MockFinish.STOP and outs[-1].matched == 9


def test_abort_running_and_queued() -> None:
    sched = MockScheduler(max_batch=1)
    sched.add(MockRequest(rid="run", prompt_ids=[5], max_tokens=100))
    sched.add(MockRequest(rid="queued", prompt_ids=[5], max_tokens=100))
    sched.step()
    sched.abort("run")
    sched.abort("queued")
    outs = sched.step()
    assert [(o.rid, o.finish) for o in outs] == [("run", MockFinish.ABORT)]
    assert sched.take_aborted_queued() == ["queued"]
    assert sched.idle


def test_nonstream_reports_every_interval_and_at_end() -> None:
    sched = MockScheduler(max_batch=1, nonstream_interval=4)
    sched.add(MockRequest(rid="a", prompt_ids=[5, 6], max_tokens=10, stream=False))
    sizes = [len(o.new_ids) for _ in range(12) for o in sched.step()]
    assert sizes == [4, 4, 2]


def test_completion_tokens_cumulative() -> None:
    sched = MockScheduler(max_batch=1)
    sched.add(MockRequest(rid="a", prompt_ids=[5], max_tokens=3))
    counts = [o.completion_tokens for _ in range(3) for o in sched.step()]
    assert counts == [1, 2, 3]
