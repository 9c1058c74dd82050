"""Record what vLLM 0.32's chat server renders for every corpus case and template (the oracle).

Runs under the vLLM venv (``.ci/vllm-env.sh`` builds it), never smgd's::

    $VLLM_PYTHON tests/chat_corpus/make_expected.py              # rewrites expected.json
    $VLLM_PYTHON tests/chat_corpus/make_expected.py OUT.json     # writes elsewhere

Each case goes the way of a /v1/chat/completions request through vLLM's server: the body is
validated by its request model (``ChatCompletionRequest``); the tools become the dicts its
server hands the template (``tool.model_dump()``); the messages become the conversation its
renderer builds (``parse_chat_messages``, with the content format it detects in the
template); and ``safe_apply_chat_template`` (developer -> system where the template does not
know the role) calls transformers' ``apply_chat_template`` with the tokenizer of smgd's tiny
model, whose special tokens the templates read. The prompt text, or the error, is recorded.

A case where smgd differs on purpose carries ``vllm_messages``, an input vLLM takes that means
what smgd makes of ``messages``: vLLM renders that one.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CORPUS = HERE / "corpus.json"
TEMPLATES = HERE / "templates"
EXPECTED = HERE / "expected.json"
TOKENIZER_DIR = ROOT / "smgd" / "assets" / "tiny-model"


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else EXPECTED
    logging.disable(logging.WARNING)  # vLLM logs every coerced argument; the record says it

    # Imported by name: these exist only in the vLLM venv, which smgd's type check never sees.
    transformers = importlib.import_module("transformers")
    vllm = importlib.import_module("vllm")
    protocol = importlib.import_module("vllm.entrypoints.openai.chat_completion.protocol")
    hf = importlib.import_module("vllm.renderers.hf")
    chat_utils = importlib.import_module("vllm.renderers.chat_utils")

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    # What parse_chat_messages and safe_apply_chat_template read of a model config for a
    # text-only model whose template is given.
    model_config: Any = SimpleNamespace(
        enable_prompt_embeds=False, multimodal_config=None, hf_config=SimpleNamespace()
    )
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    templates = {p.stem: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.jinja"))}
    record: dict[str, Any] = {
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "templates": {
            name: {
                "content_format": hf._detect_content_format(source, default="string"),
                "developer_role": hf._detect_developer_role_support(source),
            }
            for name, source in templates.items()
        },
        "cases": {},
    }
    for case in corpus["cases"]:
        tools = case.get("tools")
        if isinstance(tools, str):
            tools = corpus["tools"][tools]
        results: dict[str, Any] = {}
        for name in sorted(templates):
            source = templates[name]
            body = {"model": "m", "messages": case.get("vllm_messages", case["messages"])}
            if tools is not None:
                body["tools"] = tools
            try:
                request = protocol.ChatCompletionRequest.model_validate(
                    json.loads(json.dumps(body))
                )
                tool_dicts = (
                    [tool.model_dump() for tool in request.tools] if request.tools else None
                )
                conversation, _, _ = chat_utils.parse_chat_messages(
                    request.messages,
                    model_config,
                    content_format=record["templates"][name]["content_format"],
                )
                prompt = hf.safe_apply_chat_template(
                    model_config,
                    tokenizer,
                    conversation,
                    tools=tool_dicts,
                    chat_template=source,
                    tokenize=False,
                    add_generation_prompt=case.get("add_generation_prompt", True),
                    **case.get("kwargs", {}),
                )
            except Exception as exc:  # the record says which cases vLLM refuses, and why
                results[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            else:
                results[name] = {"prompt": prompt}
        record["cases"][case["id"]] = results
    text = json.dumps(record, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: {len(record['cases'])} cases x {len(templates)} templates")


if __name__ == "__main__":
    main()
