"""Write tests/vectors/sglang_lora.json: a generate request with a LoRA adapter, made by
SGLang's OWN msgpack encoder, as its TokenizerManager builds it.

Run with the SGLang venv's python (``eval "$(bash .ci/sglang-env.sh)"``)::

    PYTHONPATH=smgd/launchers/cpu_shims $SGLANG_PYTHON tests/vectors/make_sglang_lora_vectors.py

The request names the adapter in ``lora_path`` (SGLang's /generate and its OpenAI server's
``model: base:adapter`` both end there); the TokenizerManager's registry resolves it to the
adapter's ``lora_id``, which for a ``--lora-paths name=path`` adapter is
``LoRARef.deterministic_id(name, path)``. The request itself is built by
make_sglang_vectors.py's ``tokenized`` (imported: this script adds only the LoRA fields).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import make_sglang_vectors as base
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.managers import io_struct as io

OUT = Path(__file__).with_name("sglang_lora.json")
NAME, PATH = "sql", "/adapters/sql"


def main() -> int:
    prompt = [1, 385, 600, 436, 943, 14, 10, 385]
    lora_id = LoRARef.deterministic_id(NAME, PATH)
    req = base.tokenized(
        base.RID,
        prompt,
        {"max_new_tokens": 8, "temperature": 0.0},
        stream=True,
        lora_path=NAME,
        lora_id=lora_id,
    )
    entry = {
        "name": "tgri_lora",
        "hex": io.msgpack_encode(req).hex(),
        "lora": {"name": NAME, "path": PATH, "lora_id": lora_id},
        "smgd_request": base.smgd_request(base.RID, prompt, True, max_tokens=8, temperature=0.0),
    }
    doc = {"engine": "sglang 0.5.23", "vectors": [entry]}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
