"""``POST /v1/embeddings`` through the whole daemon and its mock engines on both embedding wires.

The mock answers an embedding request with :func:`~smgd.mock.scheduler.mock_embedding` of its
token ids, so every vector a client gets can be computed here from the ids the daemon had to
send: a wrong tokenization, order, truncation or encoding shows as a different vector.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
from typing import TYPE_CHECKING, Any

import pytest

from smgd.assets import TINY_MODEL_DIR
from smgd.mock.scheduler import MOCK_EMBED_SIZE, mock_embedding
from smgd.text.tokenizer import load_tokenizer

from .daemon_harness import config_text, engine_toml, running_daemon

if TYPE_CHECKING:
    from pathlib import Path

    import httpx

pytestmark = pytest.mark.slow

TOKENIZER = load_tokenizer(TINY_MODEL_DIR)
WIRES = ("sglang", "vllm")


def _matryoshka_model(tmp_path: Path) -> Path:
    """The packaged tiny model, declared Matryoshka with three dimensions."""
    model = tmp_path / "matryoshka"
    shutil.copytree(TINY_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, MOCK_EMBED_SIZE]
    (model / "config.json").write_text(json.dumps(config))
    return model


def _config(tmp_path: Path) -> Path:
    def embed(wire: str) -> str:  # the mock's wire goes in the [engines.mock] table it ends with
        name = f"emb-{wire}"
        return engine_toml(name, name, step_ms=1.0, extra='task = "embed"\n') + f'wire = "{wire}"\n'

    matryoshka = engine_toml("mat", "mat", step_ms=1.0, extra='task = "embed"\n')
    matryoshka = matryoshka.replace(str(TINY_MODEL_DIR), str(_matryoshka_model(tmp_path)))
    path = tmp_path / "smgd.toml"
    path.write_text(
        config_text(embed("sglang"), embed("vllm"), matryoshka, engine_toml("gen", "gen"))
    )
    return path


def ids_of(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=True)


def floats(data: dict[str, Any]) -> list[list[float]]:
    return [item["embedding"] for item in data["data"]]


async def post(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/embeddings", json=body)


async def test_every_input_shape_is_embedded_in_order_on_both_wires(tmp_path: Path) -> None:
    async with running_daemon(_config(tmp_path)) as (_, client):
        for wire in WIRES:
            model = f"emb-{wire}"
            texts = ["The quick brown fox", "jumps over", "the lazy dog"]
            cases: list[tuple[Any, list[list[int]]]] = [
                ("hello world", [ids_of("hello world")]),
                (texts, [ids_of(t) for t in texts]),
                ([5, 6, 7, 8], [[5, 6, 7, 8]]),
                ([[5, 6], [9, 10, 11], "fox"], [[5, 6], [9, 10, 11], ids_of("fox")]),
            ]
            for given, ids in cases:
                r = await post(client, model=model, input=given, user="someone")
                assert r.status_code == 200, r.text
                data = r.json()
                assert data["object"] == "list"
                assert data["model"] == model
                assert [d["index"] for d in data["data"]] == list(range(len(ids)))
                assert {d["object"] for d in data["data"]} == {"embedding"}
                assert floats(data) == [mock_embedding(i) for i in ids], (wire, given)
                total = sum(len(i) for i in ids)
                assert data["usage"] == {"prompt_tokens": total, "total_tokens": total}


async def test_base64_is_the_little_endian_float32_bytes_of_the_vector(tmp_path: Path) -> None:
    async with running_daemon(_config(tmp_path)) as (_, client):
        for wire in WIRES:
            r = await post(
                client, model=f"emb-{wire}", input=["a b", "c d e"], encoding_format="base64"
            )
            assert r.status_code == 200, r.text
            for item, text in zip(r.json()["data"], ["a b", "c d e"], strict=True):
                raw = base64.b64decode(item["embedding"])
                vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
                assert vector == mock_embedding(ids_of(text))


async def test_dimensions_only_for_a_matryoshka_model(tmp_path: Path) -> None:
    async with running_daemon(_config(tmp_path)) as (_, client):
        r = await post(client, model="mat", input="hello", dimensions=16)
        assert r.status_code == 200, r.text
        assert floats(r.json()) == [mock_embedding(ids_of("hello"), 16)]
        for model, dims, words in (
            ("mat", 20, "only supports Matryoshka dimensions"),
            ("mat", 65, "range [1, 64]"),
            ("emb-sglang", 16, "does not support Matryoshka"),
            ("emb-vllm", 0, "positive integer"),
        ):
            r = await post(client, model=model, input="hello", dimensions=dims)
            assert r.status_code == 400, (model, dims, r.text)
            error = r.json()["error"]
            assert error["param"] == "dimensions"
            assert words in error["message"]


async def test_model_and_input_errors_name_their_parameter(tmp_path: Path) -> None:
    async with running_daemon(_config(tmp_path)) as (_, client):
        r = await post(client, model="nope", input="x")
        assert r.status_code == 404
        assert r.json()["error"]["param"] == "model"
        r = await post(client, model="gen", input="x")
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "model"
        assert "not an embedding model" in r.json()["error"]["message"]
        gen = await client.post(
            "/v1/completions", json={"model": "emb-vllm", "prompt": "x", "max_tokens": 2}
        )
        assert gen.status_code == 400, gen.text
        assert gen.json()["error"]["param"] == "model"
        bad: list[tuple[dict[str, Any], str]] = [
            ({"input": []}, "input"),
            ({"input": [[]]}, "input"),
            ({"input": [1, -2]}, "input"),
            ({"input": [1.5]}, "input"),
            ({"input": {"a": 1}}, "input"),
            ({"input": [5000]}, "input"),  # outside the 1024-token vocabulary
            ({"input": [5] * 5000}, "input"),  # longer than the context
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            # Embedding inputs run in arrival order: a priority is refused, not ignored.
            ({"input": "x", "priority": 1}, "priority"),
            ({"input": "x", "priority": "high"}, "priority"),
            # vLLM's truncation: refused, not ignored (the whole input was embedded).
            ({"input": "x", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
            # vLLM's: raw, unnormalized vectors. Refused, not ignored (they came normalized).
            ({"input": "x", "normalize": False}, "normalize"),
            ({"input": "x", "normalize": "yes"}, "normalize"),
            ({}, "input"),
        ]
        for body, param in bad:
            r = await post(client, model="emb-sglang", **body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, body
        for model, fits in (("emb-vllm", 4096), ("emb-sglang", 4095)):  # SGLang: < context
            long = await post(client, model=model, input=[[5] * (fits + 1)])
            assert long.status_code == 400, long.text
            assert long.json()["error"]["code"] == "context_length_exceeded"
            assert (await post(client, model=model, input=[[5] * fits])).status_code == 200
        # The daemon is fine after all of that.
        ok = await post(client, model="emb-vllm", input="still here", priority=0, normalize=True)
        assert ok.status_code == 200


async def test_add_special_tokens_false_embeds_the_text_without_them(tmp_path: Path) -> None:
    # vLLM's embeddings request field (default true); it was ignored: BOS was added anyway.
    async with running_daemon(_config(tmp_path)) as (_, client):
        bare = TOKENIZER.encode("hello world", add_special_tokens=False)
        assert bare != ids_of("hello world")
        for wire in WIRES:
            r = await post(
                client, model=f"emb-{wire}", input=["hello world"], add_special_tokens=False
            )
            assert r.status_code == 200, r.text
            assert floats(r.json()) == [mock_embedding(bare)]
            assert r.json()["usage"]["prompt_tokens"] == len(bare)
        r = await post(client, model="emb-vllm", input="x", add_special_tokens="no")
        assert (r.status_code, r.json()["error"]["param"]) == (400, "add_special_tokens")
