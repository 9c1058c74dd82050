"""``priority``, ``min_tokens``, prompt logprobs and completions ``echo`` + ``logprobs``.

End to end through the mock engine on SGLang's wire (real ipc sockets, the mock's own
formulas: :func:`~smgd.mock.scheduler.mock_prompt_logprob`), on vLLM's wire at the codec level,
and the rules a real engine needs (:func:`smgd.api.core.prepare.check_engine`, the config key
and its launch flags). The real engines: tests/real_engines/test_surface_real.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from smgd.api.core.prepare import OPENAI_NAMES, ParamNames, check_engine
from smgd.config import Config as SmgdConfig
from smgd.config import EngineConfig, LaunchConfig, StructuredOutputConfig, WireFamily, validate
from smgd.engines import scheduling_args
from smgd.errors import ConfigError, InvalidRequest
from smgd.mock.scheduler import MockRequest, MockScheduler, mock_logprob, mock_prompt_logprob
from smgd.wire.common import GenerateRequest, SamplingParams
from smgd.wire.sglang.decode import decode_request
from smgd.wire.sglang.encode import encode_generate
from smgd.wire.vllm.decode import decode_outputs
from smgd.wire.vllm.decode import decode_request as vllm_decode_request
from smgd.wire.vllm.encode import encode_add
from smgd.wire.vllm.engine_side import encode_outputs, prompt_logprobs_tensors
from smgd.wire.vllm.structs import EngineCoreOutput, EngineCoreOutputs
from tests.fake_engine import MODEL, TINY_MODEL, open_app, post
from tests.faults.harness import daemon_toml, mock_engine_toml, serve
from tests.test_api_logprobs import ASCII, TOK, TT, Served, TokenspeedLike, serve_sglang_mock

PROMPT = ASCII[:6]  # no specials: the mock echoes it as it is


def completion(served: Served, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{served.base_url}/v1/completions", json={"model": MODEL, **body}, timeout=30
    )


def _prompt_rows(k: int) -> list[Any]:
    return [mock_prompt_logprob(PROMPT[p], p, k) for p in range(1, len(PROMPT))]


def _top(entry: Any) -> dict[str, float]:
    top = {TT.get(entry.token_id)[0]: entry.logprob}
    for t in entry.top or ():
        top.setdefault(TT.get(t.token_id)[0], t.logprob)
    return top


async def test_echo_with_logprobs_returns_the_prompts_then_the_outputs() -> None:
    async with serve_sglang_mock(MockScheduler(max_batch=4, skip_ids=range(6))) as served:
        reply = await served.call(
            lambda: completion(
                served, {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3}
            )
        )
        only = await served.call(
            lambda: completion(
                served, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
            )
        )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    lp = choice["logprobs"]
    rows = _prompt_rows(2)
    prompt_tokens = [TT.get(t)[0] for t in PROMPT]
    assert lp["tokens"][: len(PROMPT)] == prompt_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(PROMPT)] == [r.logprob for r in rows]
    assert lp["top_logprobs"][1 : len(PROMPT)] == [_top(r) for r in rows]
    out = PROMPT[:3]  # the mock echoes the prompt
    assert lp["token_logprobs"][len(PROMPT) :] == [
        mock_logprob(t, i, 2).logprob for i, t in enumerate(out)
    ]
    # text_offset counts every token's text from 0, as vLLM's does
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert choice["text"].startswith(TOK.decode(PROMPT, False))
    # vLLM's prompt_logprobs field: the prompt token first (with its rank), then its top-k
    field = choice["prompt_logprobs"]
    assert field[0] is None
    assert field[1] == {
        str(rows[0].token_id): {
            "logprob": rows[0].logprob,
            "rank": 1,
            "decoded_token": prompt_tokens[1],
        },
        **{
            str(t.token_id): {
                "logprob": t.logprob,
                "rank": j,
                "decoded_token": TT.get(t.token_id)[0],
            }
            for j, t in enumerate(rows[0].top or (), start=1)
            if t.token_id != rows[0].token_id
        },
    }

    assert only.status_code == 200, only.text
    choice = only.json()["choices"][0]
    assert choice["text"] == TOK.decode(PROMPT, False)  # the prompt alone
    assert choice["logprobs"]["tokens"] == prompt_tokens
    assert choice["logprobs"]["token_logprobs"][1:] == [r.logprob for r in _prompt_rows(1)]
    assert only.json()["usage"]["completion_tokens"] == 1  # the engine made one, as vLLM counts


async def test_streamed_echo_carries_the_prompt_logprobs_first() -> None:
    async with serve_sglang_mock(MockScheduler(max_batch=4, skip_ids=range(6))) as served:

        def run() -> list[Any]:
            stream = served.client.completions.create(
                model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=2, stream=True
            )
            return [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]

        chunks = await served.call(run)
    first = chunks[0]
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1 : len(PROMPT)] == [r.logprob for r in _prompt_rows(1)]
    every = [v for c in chunks for v in c.token_logprobs]
    assert len(every) == len(PROMPT) + 2


async def test_native_prompt_logprobs_in_sglangs_shape() -> None:
    async with serve_sglang_mock(MockScheduler(max_batch=4, skip_ids=range(6))) as served:
        reply = await served.call(
            lambda: httpx.post(
                f"{served.base_url}/generate",
                json={
                    "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
                    "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                },
                timeout=30,
            )
        )  # fmt: skip
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    rows = _prompt_rows(2)
    assert meta["input_token_logprobs"] == [
        [None, PROMPT[0], None],
        *([r.logprob, r.token_id, None] for r in rows),
    ]
    assert meta["input_top_logprobs"] == [
        None,
        *([[t.logprob, t.token_id, None] for t in r.top or ()] for r in rows),
    ]
    assert len(meta["output_token_logprobs"]) == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "logprobs": 21}, "logprobs"),  # vLLM's limit, 20
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),  # no whole-vocab rows
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # only with echo
        ({"prompt": "a", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
        ({"prompt": "a", "priority": 1}, "priority"),  # the engine is not "priority"
        ({"prompt": "a", "priority": 2**31}, "priority"),
    ],
)
async def test_refusals_name_the_parameter(body: dict[str, Any], param: str) -> None:
    async with serve_sglang_mock(MockScheduler(max_batch=4, skip_ids=range(6))) as served:
        reply = await served.call(lambda: completion(served, body))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


async def test_twenty_top_logprobs_and_chat_prompt_logprobs() -> None:
    async with serve_sglang_mock(MockScheduler(max_batch=4, skip_ids=range(6))) as served:
        reply = await served.call(
            lambda: completion(served, {"prompt": PROMPT, "logprobs": 20, "max_tokens": 1})
        )
        chat = await served.call(
            lambda: httpx.post(
                f"{served.base_url}/v1/chat/completions",
                json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "prompt_logprobs": 0, "max_tokens": 1,
                },
                timeout=30,
            )
        )  # fmt: skip
    assert reply.status_code == 200, reply.text
    (top,) = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
    # 20 alternatives (some share a text, so fewer keys): the mock's top-20 values
    assert set(top.values()) <= {t.logprob for t in mock_logprob(PROMPT[0], 0, 20).top or ()}
    assert min(top.values()) == mock_logprob(PROMPT[0], 0, 20).logprob - 19
    assert chat.status_code == 200, chat.text
    field = chat.json()["prompt_logprobs"]  # vLLM: at the top level for chat
    assert field[0] is None and len(field) > 2
    assert all(len(row) == 1 for row in field[1:])  # the prompt token alone (k = 0)


def test_min_tokens_holds_back_stop_ids_on_the_mock() -> None:
    def run(**kw: Any) -> list[int]:
        sched = MockScheduler(max_batch=1, eos_ids=[2])
        sched.add(MockRequest(rid="r", prompt_ids=[7, 2, 8, 9], max_tokens=12, **kw))
        ids: list[int] = []
        while not sched.idle:
            for out in sched.step():
                ids += out.new_ids
        return ids

    assert run() == [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9]  # EOS is never echoed
    assert run(stop_token_ids=frozenset({8})) == [7, 8]
    # before 5 tokens the stop id is passed over (a real engine masks it), then it stops
    assert run(stop_token_ids=frozenset({8}), min_tokens=5) == [7, 9, 7, 9, 7, 8]


async def test_min_tokens_on_a_real_sglang_is_a_400_naming_the_endpoints_key() -> None:
    # serve_sglang_mock's engine is configured as an SGLang scheduler smgd did not launch
    async with serve_sglang_mock(MockScheduler(max_batch=4, skip_ids=range(6))) as served:
        openai_reply = await served.call(
            lambda: completion(served, {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 2})
        )
        native = await served.call(
            lambda: httpx.post(
                f"{served.base_url}/generate",
                json={"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 2}},
                timeout=30,
            )
        )
    assert openai_reply.status_code == 400
    assert openai_reply.json()["error"]["param"] == "min_tokens"
    assert native.status_code == 400
    assert native.json()["error"]["param"] == "sampling_params.min_new_tokens"


def test_mock_admits_lowest_priority_first_and_arrival_order_among_equals() -> None:
    sched = MockScheduler(max_batch=1, priority_scheduling=True)
    for rid, priority in (("a", 0), ("b", 5), ("c", -3), ("d", 0)):
        sched.add(MockRequest(rid=rid, prompt_ids=[7], max_tokens=1, priority=priority))
    order = [sched.step()[0].rid for _ in range(4)]
    assert order == ["c", "a", "d", "b"]
    fcfs = MockScheduler(max_batch=1)
    for rid, priority in (("a", 0), ("b", -5)):
        fcfs.add(MockRequest(rid=rid, prompt_ids=[7], max_tokens=1, priority=priority))
    assert [fcfs.step()[0].rid for _ in range(2)] == ["a", "b"]


# --------------------------------------------------------------------------- engine rules


class _Engine:
    def __init__(self, wire: str, config: EngineConfig) -> None:
        self.wire, self.config, self.name = wire, config, config.name


def _config(wire: WireFamily = WireFamily.SGLANG, **kw: Any) -> EngineConfig:
    return EngineConfig(name="e", wire=wire, models=[MODEL], model_dir=str(TINY_MODEL), **kw)


NATIVE = ParamNames(
    min_tokens="sampling_params.min_new_tokens", prompt_logprobs="logprob_start_len"
)


@pytest.mark.parametrize(
    ("wire", "config", "sampling", "priority", "names", "param"),
    [
        ("sglang", _config(), {"min_tokens": 2}, None, OPENAI_NAMES, "min_tokens"),
        ("sglang", _config(), {"min_tokens": 2}, None, NATIVE, "sampling_params.min_new_tokens"),
        ("tokenspeed", _config(WireFamily.TOKENSPEED), {"prompt_logprobs": 0}, None,
         OPENAI_NAMES, "prompt_logprobs"),
        ("vllm", _config(WireFamily.VLLM), {}, 3, OPENAI_NAMES, "priority"),
    ],
)  # fmt: skip
def test_what_a_real_engine_cannot_do_is_a_400(
    wire: str, config: EngineConfig, sampling: dict[str, Any], priority: int | None,
    names: ParamNames, param: str,
) -> None:  # fmt: skip
    params = SamplingParams(max_tokens=8, **sampling)
    with pytest.raises(InvalidRequest) as info:
        check_engine(_Engine(wire, config), params, priority, names)  # type: ignore[arg-type]
    assert info.value.param == param


def test_min_tokens_goes_to_sglang_schedulers_that_load_their_tokenizer() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=2)

    def sglang(args: list[str], **kw: Any) -> _Engine:
        return _Engine("sglang", _config(launch=LaunchConfig(kind="sglang", args=args), **kw))

    assert check_engine(sglang([]), params, None, OPENAI_NAMES) is None  # type: ignore[arg-type]
    for engine in (
        sglang(["--skip-tokenizer-init"]),
        sglang(["--grammar-backend", "none"]),
        sglang(["--grammar-backend=none"]),
        sglang([], structured_output=StructuredOutputConfig(backend="none")),
    ):
        with pytest.raises(InvalidRequest):
            check_engine(engine, params, None, OPENAI_NAMES)  # type: ignore[arg-type]


def test_priority_goes_to_engines_that_schedule_by_it() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=2)
    mock = _Engine("sglang", _config(WireFamily.MOCK))
    assert check_engine(mock, params, None, OPENAI_NAMES) is None  # type: ignore[arg-type]
    assert check_engine(mock, params, 0, OPENAI_NAMES) is None  # type: ignore[arg-type]
    prio = _Engine("vllm", _config(WireFamily.VLLM, scheduling="priority"))
    assert check_engine(prio, params, 4, OPENAI_NAMES) == 4  # type: ignore[arg-type]
    # SGLang runs requests without one last: smgd sends 0
    assert check_engine(prio, params, None, OPENAI_NAMES) == 0  # type: ignore[arg-type]


def test_scheduling_key_sets_each_engines_flags_and_is_checked() -> None:
    def launched(kind: str, **kw: Any) -> EngineConfig:
        wire = WireFamily.MOCK if kind == "mock" else WireFamily(kind)
        return _config(wire, launch=LaunchConfig(kind=kind), **kw)  # type: ignore[arg-type]

    assert scheduling_args(launched("vllm", scheduling="priority")) == [
        "--scheduling-policy", "priority",
    ]  # fmt: skip
    assert scheduling_args(launched("sglang", scheduling="priority")) == [
        "--enable-priority-scheduling", "--schedule-low-priority-values-first",
    ]  # fmt: skip
    assert scheduling_args(launched("mock", scheduling="priority")) == ["--priority-scheduling"]
    assert scheduling_args(launched("vllm")) == []
    bad = [
        (_config(WireFamily.TOKENSPEED, scheduling="priority"), "$.engines[0].scheduling"),
        (
            _config(
                WireFamily.VLLM,
                launch=LaunchConfig(kind="vllm", args=["--scheduling-policy=priority"]),
            ),
            "$.engines[0].launch.args",
        ),
    ]
    for engine, path in bad:
        with pytest.raises(ConfigError) as info:
            validate(SmgdConfig(engines=[engine]), check_paths=False)
        assert info.value.path == path


# --------------------------------------------------------------------------- wire


def test_encoders_carry_priority_min_tokens_and_prompt_logprobs() -> None:
    sampling = SamplingParams(max_tokens=8, min_tokens=3, logprobs=1, prompt_logprobs=4)
    req = GenerateRequest(rid="r1", prompt_ids=[5, 6, 7], sampling=sampling, priority=-2)
    msg = decode_request(encode_generate(req))
    assert msg.priority == -2  # type: ignore[union-attr]
    assert msg.sampling_params.min_new_tokens == 3  # type: ignore[union-attr]
    assert msg.logprob_start_len == 0 and msg.top_logprobs_num == 4  # type: ignore[union-attr]
    add = vllm_decode_request(encode_add(req, arrival_time=0.0))
    core = add.request  # type: ignore[union-attr]
    assert core.priority == -2 and core.sampling_params is not None
    assert core.sampling_params.prompt_logprobs == 4 and core.sampling_params.min_tokens == 3


def test_vllm_prompt_logprob_tensors_decode_with_ranks() -> None:
    rows = [mock_prompt_logprob(t, p, 2) for p, t in enumerate([9, 10, 11]) if p]
    out = EngineCoreOutput(request_id="r", new_token_ids=[4])
    out.new_prompt_logprobs_tensors = prompt_logprobs_tensors(rows)
    frames = encode_outputs(EngineCoreOutputs(outputs=[out]))
    (delta,) = decode_outputs(frames).deltas
    assert delta.prompt_logprobs == rows


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": True, "logprobs": 0}, "echo"),
        ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ],
)
async def test_tokenspeed_has_no_prompt_logprobs(body: dict[str, Any], param: str) -> None:
    async with open_app(TokenspeedLike()) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "a", **body})
    assert reply.status == 400
    assert reply.json()["error"]["param"] == param


@pytest.mark.slow
async def test_a_priority_engine_runs_the_lowest_value_first(tmp_path: Path) -> None:
    """The whole daemon and its launched mock (``scheduling = "priority"``, one request at a
    time): while a long request runs, two more wait in the engine; the one with the lower
    priority is admitted first, though it came second."""
    engine = mock_engine_toml("m0", MODEL, step_ms=50.0, extra='scheduling = "priority"\n').replace(
        "[engines.mock]\n", "[engines.mock]\nmax_batch = 1\n"
    )
    finished: list[str] = []

    async with (
        serve(tmp_path, daemon_toml(engine)) as daemon,
        httpx.AsyncClient(base_url=daemon.url, timeout=30) as client,
    ):

        async def ask(name: str, priority: int, max_tokens: int) -> None:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens}
            reply = await client.post("/v1/completions", json={**body, "priority": priority})
            assert reply.status_code == 200, reply.text
            finished.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "first", 0, 20)  # 1 s on the engine
            await trio.sleep(0.3)  # real time: it is running
            nursery.start_soon(ask, "late", 5, 2)
            await trio.sleep(0.1)
            nursery.start_soon(ask, "urgent", -5, 2)
    assert finished == ["first", "urgent", "late"]
