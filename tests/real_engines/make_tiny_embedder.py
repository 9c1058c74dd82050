"""Make a tiny random *embedding* model from a tiny random Llama, offline.

    python make_tiny_embedder.py SRC_MODEL_DIR OUT_DIR

Copies the model (weights, tokenizer, config) made by make_tiny_llama.py (SGLang's) or
make_tiny_llama_vllm.py (vLLM's) and declares it Matryoshka in its config.json
(``matryoshka_dimensions``), so ``dimensions`` can be tested. Both engines serve a
``LlamaForCausalLM`` as an embedding model: SGLang with ``--is-embedding`` (last-token pooling,
L2-normalized), vLLM with ``--runner pooling`` (converted to ``embed``: the same pooling).
Plain stdlib: no engine import, nothing downloaded.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

# Dimensions a client may ask for; the tiny models' hidden size is 64.
MATRYOSHKA_DIMENSIONS = [16, 32, 64]


def build(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name != "config.json":
            shutil.copy2(item, out / item.name)
    config = json.loads((src / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
