"""Structured output against the real daemon and its mock engine processes (``smgd serve``).

The mock has no grammar backend: a constrained request is a 400 naming the parameter before it
reaches it. Named a backend in ``[engines.structured_output]``, it takes constrained requests
on each wire (SGLang's grammar fields, vLLM's structured_outputs map, TokenSpeed's fields
decoded by the mock) and ignores the constraint, for testing a client's HTTP side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from smgd.assets import TINY_MODEL_DIR

from .faults.harness import daemon_toml, serve

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {}}},
}


def mock(name: str, model: str, wire: str, backend: str | None) -> str:
    structured = "" if backend is None else f'[engines.structured_output]\nbackend = "{backend}"\n'
    return (
        f'[[engines]]\nname = "{name}"\nwire = "mock"\nmodels = ["{model}"]\n'
        f'model_dir = "{TINY_MODEL_DIR}"\n{structured}'
        f'[engines.mock]\nwire = "{wire}"\nstep_ms = 1.0\n'
    )


async def test_the_mock_refuses_constraints_unless_configured_with_a_backend(
    tmp_path: Path,
) -> None:
    config = daemon_toml(
        mock("plain", "plain", "sglang", None),
        *(mock(f"g-{wire}", f"g-{wire}", wire, "xgrammar") for wire in ("sglang", "vllm")),
        mock("g-tokenspeed", "g-tokenspeed", "tokenspeed", "xgrammar"),
    )
    async with serve(tmp_path, config) as d, d.client() as client:

        async def chat(model: str, **extra: Any) -> Any:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            return await client.post(
                "/v1/chat/completions", json={**body, "max_tokens": 4, **extra}
            )

        refused = await chat("plain", response_format=FORMAT)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["type"]) == ("response_format", "invalid_request_error")
        assert "engine plain has no grammar backend" in error["message"]
        for wire in ("sglang", "vllm", "tokenspeed"):
            for extra in (
                {"response_format": FORMAT},
                {"guided_choice": ["a", "b"]},
                {"structured_outputs": {"regex": "[a-z]+"}},
            ):
                reply = await chat(f"g-{wire}", **extra)
                assert reply.status_code == 200, (wire, extra, reply.text)
                assert reply.json()["choices"][0]["finish_reason"] == "length"
        native = await client.post(
            "/generate", json={"model": "g-vllm", "text": "hi", "sampling_params": {"ebnf": "x"}}
        )
        assert native.status_code == 200, native.text
        assert "Traceback" not in d.log()
