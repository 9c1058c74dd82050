"""LoRA on the wires, against vectors from the engines' own encoders.

vLLM (tests/vectors/vllm_lora.json, make_vllm_lora_vectors.py): an ADD carrying a LoRARequest,
the add_lora / remove_lora / list_loras utility calls and their answers, the scheduler stats
naming adapters. SGLang (tests/vectors/sglang_lora.json, make_sglang_lora_vectors.py): a
generate request whose adapter the TokenizerManager resolved to its ``lora_id``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from smgd.wire.common import GenerateRequest, LoraAdapter, SamplingParams
from smgd.wire.sglang.encode import encode_generate, lora_id
from smgd.wire.vllm.decode import decode_outputs, decode_request
from smgd.wire.vllm.encode import encode_add, encode_utility, lora_request
from smgd.wire.vllm.structs import AddRequest, LoRARequest, UtilityRequest

VECTORS = Path(__file__).parent / "vectors"
VLLM = {v["name"]: v for v in json.loads((VECTORS / "vllm_lora.json").read_text())["vectors"]}
SGLANG = json.loads((VECTORS / "sglang_lora.json").read_text())["vectors"][0]
ARRIVAL = 1764680000.25  # make_vllm_lora_vectors.ARRIVAL
SQL = LoraAdapter(name="sql", path="/adapters/sql", int_id=3)


def frames(name: str) -> list[bytes]:
    return [bytes.fromhex(h) for h in VLLM[name]["frames_hex"]]


def test_vllm_add_with_an_adapter_is_what_vllms_front_end_sends() -> None:
    req = GenerateRequest(
        rid="req-lora",
        prompt_ids=[323, 607, 83, 338, 15, 743, 1373, 310],
        sampling=SamplingParams(max_tokens=16, temperature=0.0, eos_token_ids=(2,)),
        lora="sql",
    )
    assert encode_add(req, arrival_time=ARRIVAL, lora=SQL) == frames("in_add_lora")
    msg = decode_request(frames("in_add_lora"))
    assert isinstance(msg, AddRequest)
    assert msg.request.lora_request == ["sql", 3, "/adapters/sql", None, False, False]


def test_vllm_lora_utility_calls_are_what_vllms_front_end_sends() -> None:
    call_id = VLLM["in_utility_add_lora"]["expect"]["call_id"]
    add = encode_utility(call_id, "add_lora", [lora_request(SQL)])
    assert add == frames("in_utility_add_lora")
    assert encode_utility(call_id, "remove_lora", [3]) == frames("in_utility_remove_lora")
    assert encode_utility(call_id, "list_loras") == frames("in_utility_list_loras")
    msg = decode_request(add)
    assert isinstance(msg, UtilityRequest)
    assert msg.args == [["sql", 3, "/adapters/sql", None, False, False]]


def test_an_inplace_load_flags_the_lora_request() -> None:
    request = lora_request(SQL)
    request.load_inplace = True
    assert request == LoRARequest("sql", 3, "/adapters/sql", None, True, False)


def test_vllm_lora_utility_answers_decode() -> None:
    ok = decode_outputs(frames("out_utility_add_lora_true")).utility
    assert ok is not None
    assert (ok.ok, ok.result, ok.failure_message) == (True, True, None)
    listed = decode_outputs(frames("out_utility_list_loras")).utility
    assert listed is not None
    assert listed.result == VLLM["out_utility_list_loras"]["expect"]["result"]
    failed = decode_outputs(frames("out_utility_add_lora_failed")).utility
    assert failed is not None
    assert not failed.ok
    assert failed.failure_message == "Loading lora sql failed: No adapter found"


def test_sglang_generate_with_an_adapter_is_what_the_tokenizer_manager_sends() -> None:
    spec: dict[str, Any] = SGLANG["smgd_request"]
    lora = SGLANG["lora"]
    req = GenerateRequest(
        rid=spec["rid"],
        prompt_ids=spec["prompt_ids"],
        stream=spec["stream"],
        sampling=SamplingParams(**spec["sampling"]),
        lora=lora["name"],
    )
    adapter = LoraAdapter(name=lora["name"], path=lora["path"], int_id=1)
    assert encode_generate(req, adapter) == bytes.fromhex(SGLANG["hex"])
    assert lora_id(lora["name"], lora["path"]) == lora["lora_id"]


def test_vllm_scheduler_stats_name_the_adapters_in_each_queue() -> None:
    batch = decode_outputs(frames("out_stats_lora"))
    assert (batch.lora_running, batch.lora_waiting) == (["sql"], ["chat"])
    assert batch.load is not None and (batch.load.running, batch.load.waiting) == (2, 1)
