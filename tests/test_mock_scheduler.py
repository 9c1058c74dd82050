"""The sans-IO mock scheduler: batching, limits, stops, aborts, scripted replies, the prefix
cache; and the bounds of what a mock wire records."""

from __future__ import annotations

from collections.abc import Callable

from smgd.config import MockReply, MockScript
from smgd.mock.engine import RECORDED, MockWire, record, record_in
from smgd.mock.scheduler import (
    PREFIX_BLOCK,
    PREFIX_CACHE_BLOCKS,
    MockFinish,
    MockRequest,
    MockScheduler,
)
from smgd.mock.script import Script
from smgd.mock.tokenspeed import TokenspeedMockWire
from smgd.mock.vllm import VllmMockWire
from smgd.wire.common import GenerateRequest, SamplingParams
from smgd.wire.tokenspeed.encode import encode_abort as tokenspeed_abort
from smgd.wire.tokenspeed.encode import encode_add as tokenspeed_add
from smgd.wire.vllm.encode import encode_abort as vllm_abort
from smgd.wire.vllm.encode import encode_add as vllm_add


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


# ----------------------------------------------------------------- scripted replies


# A toy tokenizer: each character is a token (its code point), so replies read as text.
def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def _decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def _script(*replies: tuple[str, str]) -> Script:
    parsed = MockScript(reply=[MockReply(when=when, text=text) for when, text in replies])
    return Script.build(parsed, encode=_encode, decode=_decode)


EOS = 3


def _scripted(*replies: tuple[str, str]) -> MockScheduler:
    return MockScheduler(max_batch=8, eos_ids=[EOS, 4], skip_ids=[1], script=_script(*replies))


def test_script_writes_the_first_matching_reply_then_eos() -> None:
    sched = _scripted(("weather", "<tool_call>{}</tool_call>"), ("", "default"))
    sched.add(MockRequest(rid="a", prompt_ids=_encode("the weather?"), max_tokens=100))
    sched.add(MockRequest(rid="b", prompt_ids=_encode("hello"), max_tokens=100))
    outs = [o for _ in range(40) for o in sched.step()]
    ids = {rid: [t for o in outs if o.rid == rid for t in o.new_ids] for rid in "ab"}
    assert ids["a"] == [*_encode("<tool_call>{}</tool_call>"), EOS]
    assert ids["b"] == [*_encode("default"), EOS]
    last = {o.rid: o for o in outs if o.finish is not None}
    assert last["a"].finish is MockFinish.STOP and last["a"].matched == EOS
    assert last["a"].completion_tokens == len("<tool_call>{}</tool_call>") + 1


def test_prompts_no_reply_is_for_are_echoed() -> None:
    sched = _scripted(("weather", "sunny"))
    sched.add(MockRequest(rid="a", prompt_ids=[1, 10, 11, 12], max_tokens=7))
    assert run_to_end(sched)["a"] == [10, 11, 12, 10, 11, 12, 10]


def test_reply_is_cut_by_max_tokens_and_repeats_with_ignore_eos() -> None:
    sched = _scripted(("", "<think>x"))
    sched.add(MockRequest(rid="cut", prompt_ids=[9], max_tokens=3))
    sched.add(MockRequest(rid="again", prompt_ids=[9], max_tokens=18, ignore_eos=True))
    out = run_to_end(sched)
    assert out["cut"] == _encode("<th")
    assert out["again"] == [*_encode("<think>x"), EOS, *_encode("<think>x"), EOS]


def test_reply_matches_special_token_text_in_the_prompt() -> None:
    # The prompt is decoded with its special tokens, so a reply can key on template markup.
    sched = _scripted(("<tool_response>", "done"), ("", "call"))
    sched.add(MockRequest(rid="a", prompt_ids=_encode("<tool_response>21"), max_tokens=10))
    assert run_to_end(sched)["a"] == [*_encode("done"), EOS]


def test_empty_script_is_the_echo() -> None:
    sched = _scripted()
    sched.add(MockRequest(rid="a", prompt_ids=[10, 11], max_tokens=3))
    assert run_to_end(sched)["a"] == [10, 11, 10]


def _first_cached(sched: MockScheduler, rid: str, prompt: list[int]) -> int:
    sched.add(MockRequest(rid=rid, prompt_ids=prompt, max_tokens=1))
    cached = {o.rid: o.cached_tokens for o in sched.step()}[rid]
    run_to_end(sched)
    return cached


def test_prefix_cache_counts_whole_blocks_a_prompt_shares_with_earlier_ones() -> None:
    sched = MockScheduler(max_batch=4)
    prompt = list(range(100, 150))  # 50 tokens: three whole blocks of 16
    assert _first_cached(sched, "a", prompt) == 0
    assert _first_cached(sched, "b", prompt) == 3 * PREFIX_BLOCK
    # A prompt sharing the first 40 tokens shares two whole blocks; a block that differs in
    # its last token is another block, and so is every block after it (the hash chain).
    assert _first_cached(sched, "c", prompt[:40] + [7] * 30) == 2 * PREFIX_BLOCK
    changed = [*prompt[:31], 9, *prompt[32:]]
    assert _first_cached(sched, "d", changed) == PREFIX_BLOCK


def test_prefix_cache_is_bounded_and_drops_the_least_recently_used() -> None:
    """It kept every prefix of every prompt as a tuple of its tokens: 2,000 distinct
    2,048-token prompts held 2.1 GB of the built-in mock's memory."""
    sched = MockScheduler(max_batch=4)
    kept = list(range(1000, 1000 + PREFIX_BLOCK))
    assert _first_cached(sched, "kept", kept) == 0
    gone = list(range(2000, 2000 + PREFIX_BLOCK))
    assert _first_cached(sched, "gone", gone) == 0
    blocks_per_prompt = 64
    for i in range(PREFIX_CACHE_BLOCKS // blocks_per_prompt):
        if i % 16 == 0:  # used again now and then: stays
            assert _first_cached(sched, f"kept{i}", kept) == PREFIX_BLOCK
        filler = [3000 + i] + [5] * (blocks_per_prompt * PREFIX_BLOCK - 1)
        sched._cached(filler)
    assert len(sched._prefix_blocks) <= PREFIX_CACHE_BLOCKS
    assert _first_cached(sched, "kept-last", kept) == PREFIX_BLOCK
    assert _first_cached(sched, "gone-again", gone) == 0


def test_a_mock_wires_records_keep_the_latest_and_stay_bounded() -> None:
    entries: list[str] = []
    table: dict[str, int] = {}
    for i in range(5 * RECORDED):
        record(entries, f"r{i}")
        record_in(table, f"r{i}", i)
        assert len(entries) <= 2 * RECORDED and len(table) <= 2 * RECORDED
    assert len(entries) >= RECORDED and entries[-1] == f"r{5 * RECORDED - 1}"
    assert entries == [f"r{i}" for i in range(5 * RECORDED - len(entries), 5 * RECORDED)]
    assert list(table) == entries and table[entries[0]] == 5 * RECORDED - len(entries)


def test_aborts_of_finished_requests_leave_nothing_behind_in_the_mock_wires() -> None:
    """A client that hangs up as its request ends sends the abort after the finish: the mock
    kept each such rid (to not answer its abort) for good, one entry per request."""
    from smgd.mock.tokenspeed import TokenspeedMockWire
    from smgd.mock.vllm import VllmMockWire
    from smgd.wire.tokenspeed.encode import encode_abort as tokenspeed_abort
    from smgd.wire.vllm.encode import encode_abort as vllm_abort

    sched = MockScheduler(max_batch=1)
    vllm = VllmMockWire("tcp://127.0.0.1:1", log_stats=False)  # no stats-only message
    tokenspeed = TokenspeedMockWire("tcp://127.0.0.1:1")
    for i in range(1_000):
        assert vllm.on_request(vllm_abort([f"gone-{i}"]), sched) == []
        assert tokenspeed.on_request(tokenspeed_abort([f"gone-{i}"]), sched) == []
    assert not vllm._client_aborted and not tokenspeed._client_aborted
    assert sched.idle
    # The abort of a running request is still not answered (vLLM and TokenSpeed never do).
    sched.add(MockRequest(rid="run", prompt_ids=[5], max_tokens=100))
    sched.step()
    vllm.on_request(vllm_abort(["run"]), sched)
    assert vllm.encode_step(sched.step(), sched.take_aborted_queued(), sched) == []
    assert not vllm._client_aborted and sched.idle


def test_abort_says_whether_it_found_a_request() -> None:
    sched = MockScheduler(max_batch=1)
    sched.add(MockRequest(rid="run", prompt_ids=[5], max_tokens=100))
    sched.add(MockRequest(rid="queued", prompt_ids=[5], max_tokens=100))
    sched.step()
    assert sched.abort("run") and sched.abort("queued")
    assert not sched.abort("finished-long-ago")


Frames = Callable[[str], list[bytes]]


def _mock_wires() -> tuple[VllmMockWire, TokenspeedMockWire, list[tuple[MockWire, Frames, Frames]]]:
    """The vLLM and TokenSpeed mock wires, each with its wire's ADD (a 1-token prompt, 100
    tokens, logprobs and an EOS id: every per-request table filled) and ABORT of one rid."""
    sampling = SamplingParams(max_tokens=100, logprobs=0, eos_token_ids=(2,))

    def request(rid: str) -> GenerateRequest:
        return GenerateRequest(rid=rid, prompt_ids=[5], sampling=sampling)

    vllm = VllmMockWire("tcp://127.0.0.1:1")
    tokenspeed = TokenspeedMockWire("tcp://127.0.0.1:1")
    return (
        vllm,
        tokenspeed,
        [
            (vllm, lambda rid: vllm_add(request(rid)), lambda rid: vllm_abort([rid])),
            (
                tokenspeed,
                lambda rid: tokenspeed_add(request(rid)),
                lambda rid: tokenspeed_abort([rid]),
            ),
        ],
    )


def test_requests_aborted_in_the_queue_leave_nothing_behind_in_the_mock_wires() -> None:
    """A request aborted before it ran never finishes in a step: the vLLM mock kept its EOS id
    and logprobs count, the TokenSpeed mock its logprobs flag, one entry per such request."""
    vllm, tokenspeed, cases = _mock_wires()
    for wire, add, abort in cases:
        sched = MockScheduler(max_batch=1)
        wire.on_request(add("run"), sched)
        sched.step()  # "run" runs: the others queue behind it
        for i in range(100):
            rid = f"queued-{i}"
            wire.on_request(add(rid), sched)
            wire.on_request(abort(rid), sched)
            wire.encode_step(sched.step(), sched.take_aborted_queued(), sched)
        wire.on_request(abort("run"), sched)
        wire.encode_step(sched.step(), sched.take_aborted_queued(), sched)
        assert sched.idle
    assert not (vllm._eos or vllm._logprobs or vllm._queued_at or vllm._prefilled)
    assert not vllm._client_aborted
    assert not (tokenspeed._logprobs or tokenspeed._client_aborted)


def test_requests_the_lose_fault_dropped_are_forgotten_at_their_abort() -> None:
    """The "lose" fault drops a request in the scheduler after the wire noted its EOS id and
    logprobs: smgd's abort (``timeouts.request_s``) is the last the mock hears of it."""
    vllm, tokenspeed, cases = _mock_wires()
    for wire, add, abort in cases:
        sched = MockScheduler(max_batch=1)
        sched.lose_requests = True
        for i in range(100):
            wire.on_request(add(f"lost-{i}"), sched)
            wire.on_request(abort(f"lost-{i}"), sched)
        assert sched.idle
    assert not (vllm._eos or vllm._logprobs or vllm._queued_at or vllm._client_aborted)
    assert not (tokenspeed._logprobs or tokenspeed._client_aborted)
