"""Prompt logprobs, completions ``echo`` + ``logprobs``, ``min_tokens`` and ``priority`` on the
real engines, against each engine's own front end run concurrently with the same engine
settings: vLLM's offline ``LLM.generate`` (``vllm_offline_logprobs.py``) and SGLang's offline
``Engine.generate`` (``sglang_offline_logprobs.py``, its TokenizerManager and scheduler).

vLLM, one engine start (~50 s here), launched by the daemon with ``scheduling = "priority"``:

- lm-eval's loglikelihood request (``echo: true, max_tokens: 1, logprobs: 1`` on token ids)
  and its ``max_tokens: 0`` form: the prompt tokens' logprobs and top-1 equal vLLM's prompt
  logprobs, the first is ``null``; the generated token's equals vLLM's;
- ``prompt_logprobs: 3`` with ``logprobs: 2``: the ``prompt_logprobs`` field (ids, values,
  ranks) and the output logprobs equal vLLM's;
- ``min_new_tokens`` on a prompt whose greedy output ends on EOS after 18 tokens: the ids
  equal vLLM's with the same ``min_tokens``, and are longer;
- a request with a ``priority`` is served (the engine refuses one unless started with
  ``--scheduling-policy priority``).

SGLang, one scheduler start (~40 s), launched with ``scheduling = "priority"`` and its tokenizer
(the launcher's default): ``/generate`` with ``logprob_start_len: 0`` and top-2 returns SGLang's
own ``input_token_logprobs`` / ``input_top_logprobs`` / output logprobs; lm-eval's echo request
gives those prompt values; ``min_new_tokens`` holds a stop id back exactly as SGLang does.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from ..engine_harness import short_ipc_dir
from . import daemon_real
from .oracle_result import oracle_result
from .test_vllm_daemon import (
    ENGINE_ARGS,
    EOS,
    EOS_PROMPT,
    HELLO,
    MODEL,
    OFFLINE_ENGINE,
    STARTUP_S,
    daemon,
    timing,
    vllm_env,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline_logprobs.py")
MIN_TOKENS = 24  # past the 18 tokens EOS_PROMPT's greedy output has without it
REQUESTS: list[dict[str, Any]] = [
    # What lm-eval's loglikelihood asks: the engine makes one token; vLLM's front end turns
    # echo + logprobs into prompt_logprobs = logprobs.
    {"prompt_ids": HELLO, "max_tokens": 1, "logprobs": 1, "prompt_logprobs": 1},
    {"prompt_ids": HELLO, "max_tokens": 4, "logprobs": 2, "prompt_logprobs": 3},
    {"prompt_ids": EOS_PROMPT, "max_tokens": 32},
    {"prompt_ids": EOS_PROMPT, "max_tokens": 32, "min_tokens": MIN_TOKENS},
]


def config(run_dir: Path, python: str, model: str) -> Path:
    path = run_dir / "smgd.toml"
    path.write_text(
        f'run_dir = "{run_dir}"\n[server]\nport = 0\ndrain_timeout_s = 5\n'
        '[logging]\nlevel = "warning"\n'
        f'[[engines]]\nname = "v0"\nwire = "vllm"\nmodels = ["{MODEL}"]\nmodel_dir = "{model}"\n'
        'scheduling = "priority"\n'
        f"[engines.timeouts]\nready_s = {STARTUP_S}\n"
        f'[engines.launch]\nkind = "vllm"\npython = "{python}"\nargs = {json.dumps(ENGINE_ARGS)}\n'
    )
    return path


async def offline(python: str, model: str, out: dict[str, Any]) -> None:
    job = {"model": model, "engine": OFFLINE_ENGINE, "requests": REQUESTS}
    t0 = time.monotonic()
    proc = await trio.run_process(
        [python, str(OFFLINE_SCRIPT)],
        stdin=json.dumps(job).encode(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    timing("offline_logprobs_total", time.monotonic() - t0)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    out.update(oracle_result(stdout, ok=proc.returncode == 0, diagnostics=stderr))


def streamed_logprobs(body: str) -> dict[int, list[float | None]]:
    """Each choice's ``token_logprobs``, joined over a streamed completion's events."""
    joined: dict[int, list[float | None]] = {}
    for line in body.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            if choice.get("logprobs"):
                joined.setdefault(choice["index"], []).extend(choice["logprobs"]["token_logprobs"])
    return joined


def own(row: list[list[Any]], token_id: int) -> float:
    """The logprob vLLM gave ``token_id`` in a [[id, logprob, rank], ...] row."""
    return float(next(max(lp, -9999.0) for tid, lp, _ in row if tid == token_id))


async def test_prompt_logprobs_echo_min_tokens_priority_match_vllm() -> None:
    python, model = vllm_env()
    expected: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(offline, python, model, expected)
        async with daemon(config(short_ipc_dir(), python, model)) as (_, _, client):
            # lm-eval's loglikelihood request (it drops the last, generated token's entry)
            lm_eval = {
                "model": MODEL, "prompt": HELLO, "echo": True, "max_tokens": 1,
                "logprobs": 1, "temperature": 0, "seed": 1234,
            }  # fmt: skip
            generated = await client.post("/v1/completions", json=lm_eval)
            loglik = await client.post("/v1/completions", json={**lm_eval, "max_tokens": 0})
            # n = 2 (sampled: vLLM takes n > 1 only so): only the first choice asks the
            # engine for the prompt's logprobs; each choice carries them, whole or streamed.
            sampled = {**lm_eval, "n": 2, "temperature": 1.0}
            loglik_n2 = await client.post("/v1/completions", json={**sampled, "max_tokens": 0})
            streamed_n2 = await client.post("/v1/completions", json={**sampled, "stream": True})
            prompt_lp = await client.post(
                "/v1/completions",
                json={
                    "model": MODEL, "prompt": HELLO, "max_tokens": 4, "logprobs": 2,
                    "prompt_logprobs": 3, "temperature": 0,
                },
            )  # fmt: skip
            native = {"model": MODEL, "input_ids": EOS_PROMPT}
            plain = await client.post(
                "/generate",
                json={**native, "sampling_params": {"max_new_tokens": 32, "temperature": 0}},
            )
            held = await client.post(
                "/generate",
                json={
                    **native,
                    "priority": 7,
                    "sampling_params": {
                        "max_new_tokens": 32, "min_new_tokens": MIN_TOKENS, "temperature": 0,
                    },
                },
            )  # fmt: skip
    outs = expected["outputs"]

    assert loglik.status_code == 200, loglik.text
    choice = loglik.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(HELLO)  # the prompt alone: max_tokens 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    rows = outs[0]["prompt_logprobs"]
    assert rows[0] is None
    assert lp["token_logprobs"][1:] == [own(rows[i], HELLO[i]) for i in range(1, len(HELLO))]
    for i in range(1, len(HELLO)):
        assert sorted(lp["top_logprobs"][i].values()) == sorted(
            max(v, -9999.0) for _, v, _ in rows[i]
        )
    assert loglik.json()["usage"]["completion_tokens"] == 1  # as vLLM counts it
    assert loglik_n2.status_code == 200, loglik_n2.text
    assert [c["logprobs"] for c in loglik_n2.json()["choices"]] == [lp, lp]
    assert streamed_n2.status_code == 200, streamed_n2.text
    streamed = streamed_logprobs(streamed_n2.text)
    assert sorted(streamed) == [0, 1]
    for joined in streamed.values():  # the prompt's, then the sampled token's own
        assert joined[:-1] == lp["token_logprobs"] and len(joined) == len(HELLO) + 1
    assert generated.status_code == 200, generated.text
    with_one = generated.json()["choices"][0]["logprobs"]
    assert with_one["token_logprobs"][:-1] == lp["token_logprobs"]
    assert with_one["token_logprobs"][-1] == own(outs[0]["logprobs"][0], outs[0]["token_ids"][0])

    assert prompt_lp.status_code == 200, prompt_lp.text
    choice = prompt_lp.json()["choices"][0]
    rows = outs[1]["prompt_logprobs"]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(rows)
    for mine, theirs in zip(got[1:], rows[1:], strict=True):
        assert {k: (v["logprob"], v["rank"]) for k, v in mine.items()} == {
            str(tid): (value, rank) for tid, value, rank in theirs
        }
    out_rows = outs[1]["logprobs"]
    token_ids = outs[1]["token_ids"]
    assert choice["logprobs"]["token_logprobs"] == [
        own(row, t) for row, t in zip(out_rows, token_ids, strict=True)
    ]

    assert plain.status_code == 200 and held.status_code == 200, (plain.text, held.text)
    assert outs[2]["token_ids"][-1] == EOS and len(outs[2]["token_ids"]) < MIN_TOKENS, (
        "EOS_PROMPT no longer ends on EOS early: pick a new one"
    )
    assert plain.json()["output_ids"] == outs[2]["token_ids"]
    assert held.json()["output_ids"] == outs[3]["token_ids"]
    assert len(held.json()["output_ids"]) >= MIN_TOKENS


# ------------------------------------------------------------------------------------ SGLang

SGLANG_OFFLINE = Path(__file__).with_name("sglang_offline_logprobs.py")
SHIMS = Path(__file__).parents[2] / "smgd" / "launchers" / "cpu_shims"
# daemon_real.SGLANG_ARGS as Engine(...) keyword arguments (what the launcher passes).
SGLANG_ENGINE = {
    "device": "cpu", "max_total_tokens": 4096, "max_running_requests": 8, "dtype": "float32",
    "attention_backend": "torch_native", "sampling_backend": "pytorch",
    "disable_overlap_schedule": True, "cuda_graph_backend_decode": "disabled",
    "cuda_graph_backend_prefill": "disabled", "log_level": "warning",
}  # fmt: skip
SGLANG_PROMPT = [1, 385, 600, 436, 943, 14, 10, 385]
STOP = 299  # the second token of SGLANG_PROMPT's greedy output
LOGPROBS = {"return_logprob": True, "logprob_start_len": 0}
SGLANG_REQUESTS: list[dict[str, Any]] = [
    {"sampling_params": {"max_new_tokens": 3}, **LOGPROBS, "top_logprobs_num": 2},
    {"sampling_params": {"max_new_tokens": 1}, **LOGPROBS, "top_logprobs_num": 1},
    {"sampling_params": {"max_new_tokens": 12, "stop_token_ids": [STOP]}},
    {"sampling_params": {"max_new_tokens": 12, "stop_token_ids": [STOP], "min_new_tokens": 6}},
]
for _r in SGLANG_REQUESTS:
    _r["input_ids"] = SGLANG_PROMPT
    _r["sampling_params"]["temperature"] = 0


def sglang_offline(python: str, model: str, job_file: Path) -> subprocess.Popen[str]:
    """SGLang's offline run, started now (it runs while the daemon's engine starts)."""
    job = {"model": model, "engine": SGLANG_ENGINE, "requests": SGLANG_REQUESTS}
    job_file.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(SHIMS), "SGLANG_USE_CPU_ENGINE": "1"}
    with job_file.open() as stdin:
        return subprocess.Popen(
            [python, str(SGLANG_OFFLINE)],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )


def test_sglang_prompt_logprobs_echo_min_tokens_priority_match_sglang() -> None:
    python, model = os.environ.get("SGLANG_PYTHON"), os.environ.get("SGLANG_MODEL")
    if not python or not model:
        pytest.fail('SGLANG_PYTHON / SGLANG_MODEL unset: run `eval "$(bash .ci/sglang-env.sh)"`')
    t0 = time.monotonic()
    oracle = sglang_offline(python, model, short_ipc_dir() / "job.json")
    try:
        with daemon_real.serve("sglang", extra='scheduling = "priority"\n') as url:
            replies = [
                daemon_real.post(url, "/generate", {**r, "priority": 3}) for r in SGLANG_REQUESTS
            ]
            loglik = daemon_real.post(
                url,
                "/v1/completions",
                {"prompt": SGLANG_PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1},
            )
            loglik_n2 = daemon_real.post(
                url,
                "/v1/completions",
                {"prompt": SGLANG_PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1, "n": 2},
            )
        out, err = oracle.communicate(timeout=600)
    finally:
        oracle.kill()
    timing("sglang_surface_total", time.monotonic() - t0)
    expected = oracle_result(out, ok=oracle.returncode == 0, diagnostics=err)["outputs"]
    for reply in replies:
        assert reply.status_code == 200, reply.text
    got = [r.json() for r in replies]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine["output_ids"] == theirs["output_ids"]
    for key in (
        "input_token_logprobs", "input_top_logprobs", "output_token_logprobs",
        "output_top_logprobs",
    ):  # fmt: skip
        assert got[0]["meta_info"][key] == expected[0]["meta_info"][key], key
    assert expected[2]["output_ids"][-1] == STOP and len(expected[2]["output_ids"]) < 6
    assert len(got[3]["output_ids"]) > 6  # the stop id held back for 6 tokens

    assert loglik.status_code == 200, loglik.text
    lp = loglik.json()["choices"][0]["logprobs"]
    # n = 2: the prompt's logprobs asked of the engine once, carried by each choice.
    assert loglik_n2.status_code == 200, loglik_n2.text
    assert [c["logprobs"] for c in loglik_n2.json()["choices"]] == [lp, lp]
    theirs = expected[1]["meta_info"]
    assert lp["token_logprobs"] == [v for v, _, _ in theirs["input_token_logprobs"]]
    assert lp["top_logprobs"][0] is None
    # The top entries by id (the tiny tokenizer has no text for most ids, so text keys merge):
    # each row is the prompt token's own entry, then SGLang's top-1.
    field = loglik.json()["choices"][0]["prompt_logprobs"]
    assert field[0] is None
    rows = zip(theirs["input_token_logprobs"][1:], theirs["input_top_logprobs"][1:], strict=True)
    for mine, (own_entry, top) in zip(field[1:], rows, strict=True):
        value, token_id, _ = own_entry
        expected_row = {str(token_id): value} | {str(t): v for v, t, _ in top if t != token_id}
        assert {k: e["logprob"] for k, e in mine.items()} == expected_row
