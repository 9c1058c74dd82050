"""Loading the chat corpus and checking smgd's rendering against a recording of vLLM's.

Used by tests/test_text_chat.py (against the committed expected.json) and by
tests/real_engines/test_chat_oracle.py (against a fresh recording from vLLM itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from smgd.assets import TINY_MODEL_DIR
from smgd.errors import InvalidRequest
from smgd.text.chat import ChatTemplate, names_developer, walks_content
from smgd.text.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.json"
TEMPLATES = HERE / "templates"
EXPECTED = HERE / "expected.json"
MAKE_EXPECTED = HERE / "make_expected.py"


@dataclass(frozen=True)
class Case:
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    add_generation_prompt: bool
    differs: str | None


def load_cases() -> list[Case]:
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    cases: list[Case] = []
    for raw in corpus["cases"]:
        tools = raw.get("tools")
        if isinstance(tools, str):
            tools = corpus["tools"][tools]
        cases.append(
            Case(
                id=raw["id"],
                messages=raw["messages"],
                tools=tools,
                kwargs=raw.get("kwargs", {}),
                add_generation_prompt=raw.get("add_generation_prompt", True),
                differs=raw.get("differs"),
            )
        )
    return cases


def template_names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def load_expected(path: Path = EXPECTED) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return record


@cache
def template(name: str) -> ChatTemplate:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    special = load_tokenizer(TINY_MODEL_DIR).special_tokens
    return ChatTemplate(source, special_tokens=special, origin=name)


def render(case: Case, name: str) -> dict[str, str]:
    """smgd's result in the recording's form: ``{"prompt": ...}`` or ``{"error": ...}``."""
    try:
        prompt = template(name).render(
            case.messages,
            tools=case.tools,
            add_generation_prompt=case.add_generation_prompt,
            **case.kwargs,
        )
    except InvalidRequest as exc:
        return {"error": f"InvalidRequest: {exc}", "param": exc.param or ""}
    return {"prompt": prompt}


def check(case: Case, name: str, recorded: dict[str, str]) -> list[str]:
    """What differs between smgd's rendering and vLLM's (empty: they agree).

    Both render the same bytes, or both refuse the request (the messages may differ). One
    difference is on purpose: tools for a template that never reads ``tools`` are refused by
    smgd (``param: tools``), where vLLM renders the prompt without them.
    """
    ours = render(case, name)
    if case.tools and not template(name).supports_tools:
        if ours.get("param") == "tools":
            return []
        return [f"smgd should refuse tools the template ignores, got {ours}"]
    if "error" in recorded:
        if "error" in ours:
            return []
        return [f"vLLM refuses it ({recorded['error']}), smgd renders {ours['prompt']!r}"]
    if "error" in ours:
        return [f"smgd refuses it ({ours['error']}), vLLM renders {recorded['prompt']!r}"]
    if ours["prompt"] != recorded["prompt"]:
        return [f"prompts differ:\n  vLLM: {recorded['prompt']!r}\n  smgd: {ours['prompt']!r}"]
    return []


def check_template(name: str, recorded: dict[str, Any]) -> list[str]:
    """smgd reads the template as vLLM does: content as parts or strings, developer role."""
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    errors: list[str] = []
    parts = walks_content(source)
    if parts != (recorded["content_format"] == "openai"):
        errors.append(f"vLLM's content format is {recorded['content_format']}, smgd parts={parts}")
    if names_developer(source) != recorded["developer_role"]:
        errors.append(f"vLLM developer_role={recorded['developer_role']}, smgd disagrees")
    return errors
