"""Write a tiny random LoRA adapter (PEFT layout) for one of the tiny test llamas.

    python make_tiny_lora.py MODEL_DIR OUT_DIR [--seed N] [--rank R]

Reads ``MODEL_DIR/config.json`` for the shapes and writes ``OUT_DIR/adapter_config.json`` and
``OUT_DIR/adapter_model.safetensors``: ``lora_A`` / ``lora_B`` for every layer's ``q_proj`` and
``v_proj``, float32, seeded. ``lora_B`` is non-zero (a freshly initialised PEFT adapter has
B = 0, which would change nothing), so greedy output with the adapter differs from the base
model's. Plain Python (no torch, no peft): the safetensors format is a little-endian u64 header
length, a JSON header of dtype / shape / byte offsets, then the raw tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
from array import array
from pathlib import Path

TARGETS = ("q_proj", "v_proj")
# Large enough that the adapter moves the tiny random model's greedy choices on the first
# tokens (the base weights have std 0.02; a delta of this size dominates them).
WEIGHT_STD = 0.1


def shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target projection."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return {"q_proj": (heads * head_dim, hidden), "v_proj": (kv_heads * head_dim, hidden)}


def tensors(
    config: dict[str, int], rank: int, seed: int
) -> dict[str, tuple[list[int], array[float]]]:
    rng = random.Random(seed)
    out: dict[str, tuple[list[int], array[float]]] = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (out_f, in_f) in shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            for name, shape in (("lora_A", [rank, in_f]), ("lora_B", [out_f, rank])):
                values = array(
                    "f", (rng.gauss(0.0, WEIGHT_STD) for _ in range(shape[0] * shape[1]))
                )
                out[f"{key}.{name}.weight"] = (shape, values)
    return out


def write_safetensors(path: Path, named: dict[str, tuple[list[int], array[float]]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(named):
        shape, values = named[name]
        if sys.byteorder != "little":
            values = array("f", values)
            values.byteswap()
        blob = values.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def make(model_dir: Path, out: Path, *, seed: int = 0, rank: int = 8) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    write_safetensors(out / "adapter_model.safetensors", tensors(config, rank, seed))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    make(args.model_dir, args.out, seed=args.seed, rank=args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
