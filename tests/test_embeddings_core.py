"""Embeddings without engine processes: the request read, ``dimensions``, the response, the config,
the mock's vectors, and a failed engine's input moved to another (fake engines)."""

from __future__ import annotations

import base64
import logging
import struct
from typing import Any

import msgspec
import pytest
import trio

from smgd.api.core.embed import (
    MAX_INPUTS,
    EmbedInput,
    check_dimensions,
    embedding_response,
    parse_embed_request,
)
from smgd.config import Config, EngineConfig, LaunchConfig, WireFamily, validate
from smgd.engines import launch_flags
from smgd.errors import ConfigError, InvalidRequest
from smgd.mock.scheduler import MOCK_EMBED_SIZE, MockRequest, MockScheduler, mock_embedding
from smgd.wire.common import EmbedRequest, EngineRequest, Finish, FinishReason, TokenDelta

from .engine_harness import VocabularyScans
from .fake_engine import MODEL, FakeEngine, open_app, post


def test_every_openai_input_shape_is_read() -> None:
    assert parse_embed_request({"input": "hi"}).inputs == [EmbedInput(text="hi")]
    assert parse_embed_request({"input": ["a", "b"]}).inputs == [
        EmbedInput(text="a"),
        EmbedInput(text="b"),
    ]
    assert parse_embed_request({"input": [1, 2]}).inputs == [EmbedInput(ids=[1, 2])]
    assert parse_embed_request({"input": [[1], "x"]}).inputs == [
        EmbedInput(ids=[1]),
        EmbedInput(text="x"),
    ]
    params = parse_embed_request({"input": "x", "encoding_format": "base64", "dimensions": 8})
    assert (params.encoding_format, params.dimensions) == ("base64", 8)
    assert parse_embed_request({"input": "x", "encoding_format": None}).encoding_format == "float"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": [True]}, "input"),
        ({"input": [[1, "a"]]}, "input"),
        ({"input": ["a", 3.5]}, "input"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({"input": "x", "dimensions": True}, "dimensions"),
        ({"input": "x", "dimensions": -1}, "dimensions"),
    ],
)
def test_bad_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_embed_request(body)
    assert info.value.param == param


def test_dimensions_follow_vllms_matryoshka_rule() -> None:
    check_dimensions(None, "m", {})
    check_dimensions(8, "m", {"is_matryoshka": True, "hidden_size": 64})
    check_dimensions(32, "m", {"matryoshka_dimensions": [32, 64], "hidden_size": 64})
    for dims, config in (
        (8, {"hidden_size": 64}),
        (65, {"is_matryoshka": True, "hidden_size": 64}),
        (16, {"matryoshka_dimensions": [32, 64], "hidden_size": 64}),
    ):
        with pytest.raises(InvalidRequest) as info:
            check_dimensions(dims, "m", config)
        assert info.value.param == "dimensions"


def test_response_carries_floats_or_their_float32_bytes() -> None:
    vectors = [[0.5, -0.25], [1.0, 0.0]]
    out = embedding_response("m", vectors, 7, "float")
    assert out["data"][1] == {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}
    assert out["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    b64 = embedding_response("m", vectors, 7, "base64")["data"][0]["embedding"]
    assert base64.b64decode(b64) == struct.pack("<2f", 0.5, -0.25)


def test_the_mock_embeds_in_one_step_with_a_vector_of_the_ids() -> None:
    vec = mock_embedding([1, 2, 3])
    assert len(vec) == MOCK_EMBED_SIZE
    assert abs(sum(x * x for x in vec) - 1.0) < 1e-5
    assert vec == [struct.unpack("<f", struct.pack("<f", x))[0] for x in vec]  # float32 values
    assert mock_embedding([1, 2, 4]) != vec
    assert len(mock_embedding([1, 2, 3], 16)) == 16
    sched = MockScheduler(max_batch=4)
    sched.add(MockRequest(rid="e", prompt_ids=[1, 2, 3], max_tokens=0, embed=True))
    (out,) = sched.step()
    assert (out.rid, out.new_ids, out.embedding, out.prompt_tokens) == ("e", [], vec, 3)
    assert sched.idle


def _engine(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = {"name": "e", "wire": WireFamily.SGLANG, "models": ["m"]}
    return EngineConfig(model_dir=".", **{**base, **kw})


def test_config_task_embed_is_checked_and_sets_launch_flags() -> None:
    validate(Config(engines=[_engine(task="embed")]), check_paths=False)
    for engine, path in (
        (_engine(wire=WireFamily.TOKENSPEED, task="embed"), "$.engines[0].task"),
        (_engine(task="embed", tool_parser="hermes"), "$.engines[0].tool_parser"),
    ):
        with pytest.raises(ConfigError) as info:
            validate(Config(engines=[engine]), check_paths=False)
        assert info.value.path == path
    with pytest.raises(ConfigError) as info:
        validate(Config(engines=[_engine(), _engine(name="f", task="embed")]), check_paths=False)
    assert info.value.path == "$.engines[1].task"
    sglang = _engine(task="embed", launch=LaunchConfig(kind="sglang"))
    vllm = _engine(wire=WireFamily.VLLM, task="embed", launch=LaunchConfig(kind="vllm"))
    assert launch_flags(sglang) == ["--is-embedding"]
    assert launch_flags(vllm) == ["--runner", "pooling"]
    assert launch_flags(_engine(launch=LaunchConfig(kind="sglang"))) == []


class FakeEmbedder(FakeEngine):
    """A fake embedding engine: each input's vector is :func:`mock_embedding` of its ids after
    one step; ``dies`` makes it crash during that step instead."""

    def __init__(self, name: str, *, dies: bool = False) -> None:
        super().__init__(name)
        self.config = msgspec.structs.replace(self.config, task="embed")
        self.dies = dies
        self.embedded: list[EmbedRequest] = []

    def _encode_request(self, req: EngineRequest) -> list[bytes]:
        assert isinstance(req, EmbedRequest)
        self.embedded.append(req)
        assert self._nursery is not None
        self._nursery.start_soon(self._embed, req)
        return [b"embed", req.rid.encode()]

    async def _embed(self, req: EmbedRequest) -> None:
        await trio.sleep(0.01)
        if self.dies:
            self.die("crashed during prefill")
            return
        vector = mock_embedding(req.prompt_ids, req.dimensions)
        finish = Finish(reason=FinishReason.LENGTH)
        prompt = len(req.prompt_ids)
        self.deliver(
            TokenDelta(rid=req.rid, token_ids=[], finish=finish, prompt_tokens=prompt,
                       embedding=vector)
        )  # fmt: skip


async def test_an_input_moves_to_another_engine_when_its_engine_dies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad, good = FakeEmbedder("a", dies=True), FakeEmbedder("b")
    with caplog.at_level(logging.WARNING, logger="smgd.api"):
        async with open_app(bad, good) as (app, _):
            reply = await post(app, "/v1/embeddings", {"model": MODEL, "input": [[5, 6], [7]]})
    assert reply.status == 200, reply.body
    assert [d["embedding"] for d in reply.json()["data"]] == [
        mock_embedding([5, 6]),
        mock_embedding([7]),
    ]
    assert len(good.embedded) == 2
    assert {r.rid for r in bad.embedded}.isdisjoint(r.rid for r in good.embedded)
    moves = sorted(r.getMessage() for r in caplog.records if "retrying on" in r.getMessage())
    assert moves == sorted(
        f"embedding {r.rid}: engine a failed; retrying on b" for r in bad.embedded
    )


async def test_with_no_other_engine_the_failure_is_reported() -> None:
    async with open_app(FakeEmbedder("a", dies=True)) as (app, _):
        reply = await post(app, "/v1/embeddings", {"model": MODEL, "input": "hello"})
    assert reply.status in (502, 503)
    assert "crashed during prefill" in reply.json()["error"]["message"]


async def test_each_inputs_token_ids_are_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Against the engine's vocabulary when the request is planned; not again at its submit.
    scans = VocabularyScans(monkeypatch)
    embedder = FakeEmbedder("a")
    async with open_app(embedder) as (app, _):
        reply = await post(app, "/v1/embeddings", {"model": MODEL, "input": [[5, 6], [7, 8, 9]]})
    assert reply.status == 200, reply.body
    assert len(embedder.embedded) == 2
    assert sorted(scans.prompts) == [[5, 6], [7, 8, 9]]
