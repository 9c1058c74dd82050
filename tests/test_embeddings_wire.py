"""Embedding messages on the SGLang and vLLM wires, against byte vectors made by the engines' own
encoders (tests/vectors/make_sglang_embed_vectors.py, make_vllm_embed_vectors.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from smgd.wire.common import EmbedRequest, FinishReason
from smgd.wire.sglang import decode as sg_decode
from smgd.wire.sglang import encode as sg_encode
from smgd.wire.sglang.structs import BatchTokenizedEmbeddingReqInput, TokenizedEmbeddingReqInput
from smgd.wire.vllm import decode as vl_decode
from smgd.wire.vllm import encode as vl_encode
from smgd.wire.vllm.structs import AddRequest

VECTORS = Path(__file__).parent / "vectors"
ARRIVAL = 1764680000.25  # make_vllm_embed_vectors.py's fixed arrival time


def _load(name: str) -> dict[str, dict[str, Any]]:
    data = json.loads((VECTORS / name).read_text())
    return {v["name"]: v for v in data["vectors"]}


SG = _load("sglang_embed.json")
VL = _load("vllm_embed.json")


@pytest.mark.parametrize("name", ["embed_plain", "embed_dimensions", "embed_long_ids"])
def test_sglang_embedding_request_is_sglangs_bytes(name: str) -> None:
    vector = SG[name]
    req = EmbedRequest(**vector["smgd_request"])
    assert sg_encode.encode_embed(req).hex() == vector["hex"]


def test_sglang_embedding_health_check_is_sglangs_bytes() -> None:
    vector = SG["embed_health_check"]
    assert sg_encode.encode_embed_health_check(vector["health_rid"]).hex() == vector["hex"]


@pytest.mark.parametrize("name", [n for n in SG if SG[n]["direction"] == "router_to_scheduler"])
def test_sglang_embedding_requests_decode_as_the_engine_reads_them(name: str) -> None:
    frame = bytes.fromhex(SG[name]["hex"])
    msg = sg_decode.decode_request(frame)
    assert isinstance(msg, TokenizedEmbeddingReqInput | BatchTokenizedEmbeddingReqInput)
    assert sg_encode.encode_message(msg) == frame


@pytest.mark.parametrize("name", ["embed_out_one", "embed_out_two", "embed_out_abort"])
def test_sglang_embedding_output_decodes_to_vectors(name: str) -> None:
    vector = SG[name]
    deltas = sg_decode.decode_output(bytes.fromhex(vector["hex"]))
    assert isinstance(deltas, list)
    assert len(deltas) == len(vector["expect"])
    for delta, want in zip(deltas, vector["expect"], strict=True):
        assert delta.rid == want["rid"]
        assert delta.token_ids == []
        assert delta.prompt_tokens == want["prompt_tokens"]
        assert delta.cached_tokens == want["cached_tokens"]
        assert delta.finish is not None
        if want["finish"]["type"] == "abort":
            assert delta.finish.reason is FinishReason.ABORT
            assert delta.finish.status_code == want["finish"]["status_code"]
            assert delta.embedding is None or delta.embedding == []
        else:
            assert delta.finish.reason is FinishReason.LENGTH
            assert delta.embedding == want["embedding"]
    # The whole message mirrors SGLang's struct: decode + encode gives its bytes back.
    frame = bytes.fromhex(vector["hex"])
    assert sg_encode.encode_message(sg_decode.decode_any(frame)) == frame


def test_sglang_sparse_embedding_fails_the_request() -> None:
    (delta,) = sg_decode.decode_output(bytes.fromhex(SG["embed_out_sparse"]["hex"]))  # type: ignore[misc]
    assert delta.finish is not None
    assert delta.finish.reason is FinishReason.ERROR
    assert "sparse" in (delta.finish.message or "")


@pytest.mark.parametrize("name", ["in_embed", "in_embed_dimensions"])
def test_vllm_embedding_request_is_vllms_bytes(name: str) -> None:
    vector = VL[name]
    want = vector["expect"]
    req = EmbedRequest(
        rid=want["request_id"], prompt_ids=want["prompt_token_ids"], dimensions=want["dimensions"]
    )
    frames = vl_encode.encode_embed(req, arrival_time=ARRIVAL)
    assert [f.hex() for f in frames] == vector["frames_hex"]
    msg = vl_decode.decode_request([bytes.fromhex(f) for f in vector["frames_hex"]])
    assert isinstance(msg, AddRequest)
    assert msg.request.sampling_params is None
    assert msg.request.pooling_params is not None
    assert msg.request.pooling_params.task == "embed"
    assert msg.request.pooling_params.dimensions == want["dimensions"]


@pytest.mark.parametrize("name", ["out_embed_inline", "out_embed_aux_two"])
def test_vllm_pooling_output_decodes_to_vectors(name: str) -> None:
    vector = VL[name]
    batch = vl_decode.decode_outputs([bytes.fromhex(f) for f in vector["frames_hex"]])
    assert [d.rid for d in batch.deltas] == list(vector["expect"])
    for delta in batch.deltas:
        want = vector["expect"][delta.rid]
        assert delta.embedding == want["embedding"]  # float32 values, exactly
        assert delta.token_ids == []
        assert delta.finish is not None
        assert delta.finish.reason is FinishReason.STOP
        assert delta.prompt_tokens == want["num_prompt_tokens"]
