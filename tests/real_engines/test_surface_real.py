"""Prompt logprobs, completions ``echo`` + ``logprobs``, ``min_tokens`` and ``priority`` on the
real vLLM engine, against vLLM's own offline ``LLM.generate`` (the engine's own front end, run
concurrently in the vLLM venv by ``vllm_offline_logprobs.py`` with the same engine settings).

One engine start (~50 s here), launched by the daemon with ``scheduling = "priority"``:

- lm-eval's loglikelihood request (``echo: true, max_tokens: 0, logprobs: 1`` on token ids):
  the prompt tokens' logprobs and top-1 equal vLLM's prompt logprobs, the first is ``null``;
- ``prompt_logprobs: 3`` with ``logprobs: 2``: the ``prompt_logprobs`` field (ids, values,
  ranks) and the output logprobs equal vLLM's;
- ``min_new_tokens`` on a prompt whose greedy output ends on EOS after 18 tokens: the ids
  equal vLLM's with the same ``min_tokens``, and are longer;
- a request with a ``priority`` is served (the engine refuses one unless started with
  ``--scheduling-policy priority``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from ..engine_harness import short_ipc_dir
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
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr.decode()[-3000:]
    out.update(json.loads(lines[-1][len("RESULT ") :]))


def own(row: list[list[Any]], token_id: int) -> float:
    """The logprob vLLM gave ``token_id`` in a [[id, logprob, rank], ...] row."""
    return float(next(max(lp, -9999.0) for tid, lp, _ in row if tid == token_id))


async def test_prompt_logprobs_echo_min_tokens_priority_match_vllm() -> None:
    python, model = vllm_env()
    expected: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(offline, python, model, expected)
        async with daemon(config(short_ipc_dir(), python, model)) as (_, _, client):
            loglik = await client.post(
                "/v1/completions",
                json={
                    "model": MODEL, "prompt": HELLO, "echo": True, "max_tokens": 0,
                    "logprobs": 1, "temperature": 0, "seed": 1234,
                },
            )  # fmt: skip
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
