"""Write tests/vectors/vllm_lora.json: vLLM's LoRA wire messages made by vLLM's OWN encoders.

Run it with the vLLM venv's python (see .ci/vllm-env.sh); smgd is not imported:

    $VLLM_PYTHON tests/vectors/make_vllm_lora_vectors.py [OUT]

An ADD whose EngineCoreRequest carries a ``LoRARequest``, and the ``add_lora`` /
``remove_lora`` / ``list_loras`` utility calls exactly as vLLM's front end sends them
(``MsgpackEncoder().encode((client_index, call_id, method, args))``), with the engine core's
answers (``UtilityOutput``) and a scheduler-stats output naming running / waiting adapters.
Same vector shape as make_vllm_vectors.py: ``name``, ``socket``, ``frames_hex``, ``expect``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ARRIVAL = 1764680000.25
TS = 12345.5
CALL_ID = 0x1234_5678_9ABC_DEF0
OUT_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_lora.json")


def main(argv: list[str]) -> None:
    out = argv[0] if argv else OUT_DEFAULT
    from vllm.lora.request import LoRARequest  # type: ignore[import-not-found,unused-ignore]
    from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.engine import (  # type: ignore[import-not-found,unused-ignore]
        EngineCoreOutputs,
        EngineCoreRequest,
        EngineCoreRequestType,
        UtilityOutput,
    )
    from vllm.v1.metrics.stats import SchedulerStats  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.serial_utils import MsgpackEncoder, UtilityResult  # type: ignore[import-not-found,unused-ignore]

    enc = MsgpackEncoder()
    vectors: list[dict[str, Any]] = []

    def add(name: str, socket: str, frames: list[Any], expect: Any = None) -> None:
        v: dict[str, Any] = {"name": name, "socket": socket, "source": "syn"}
        v["frames_hex"] = [bytes(f).hex() for f in frames]
        if expect is not None:
            v["expect"] = expect
        vectors.append(v)

    lora = LoRARequest(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql")
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    sp.update_from_generation_config({}, eos_token_id=2)
    req = EngineCoreRequest(
        request_id="req-lora",
        prompt_token_ids=[323, 607, 83, 338, 15, 743, 1373, 310],
        mm_features=None,
        sampling_params=sp,
        pooling_params=None,
        arrival_time=ARRIVAL,
        lora_request=lora,
        cache_salt=None,
        data_parallel_rank=None,
    )
    add(
        "in_add_lora",
        "input",
        [EngineCoreRequestType.ADD.value, *enc.encode(req)],
        {"lora_name": "sql", "lora_int_id": 3, "lora_path": "/adapters/sql"},
    )

    def utility(name: str, method: str, args: tuple[Any, ...]) -> None:
        frames = [EngineCoreRequestType.UTILITY.value, *enc.encode((0, CALL_ID, method, args))]
        add(name, "input", frames, {"call_id": CALL_ID, "method": method})

    utility("in_utility_add_lora", "add_lora", (lora,))
    utility("in_utility_remove_lora", "remove_lora", (3,))
    utility("in_utility_list_loras", "list_loras", ())

    def answer(name: str, result: Any, failure: str | None = None) -> None:
        outs = EngineCoreOutputs(
            engine_index=0,
            timestamp=TS,
            utility_output=UtilityOutput(
                call_id=CALL_ID,
                failure_message=failure,
                result=None if failure else UtilityResult(result),
            ),
        )
        value = sorted(result) if isinstance(result, set) else result
        add(name, "output", enc.encode(outs), {"call_id": CALL_ID, "result": value})

    answer("out_utility_add_lora_true", True)
    answer("out_utility_list_loras", {1, 3})  # a set: msgpack writes it as an array
    answer("out_utility_add_lora_failed", None, "Loading lora sql failed: No adapter found")

    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1)
    stats.running_lora_adapters = {"sql": 2}
    stats.waiting_lora_adapters = {"chat": 1}
    outs = EngineCoreOutputs(engine_index=0, timestamp=TS, scheduler_stats=stats)
    add(
        "out_stats_lora",
        "output",
        enc.encode(outs),
        {"running_lora_adapters": {"sql": 2}, "waiting_lora_adapters": {"chat": 1}},
    )

    with open(out, "w") as f:
        json.dump({"engine": "vllm 0.32.0", "vectors": vectors}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
