"""Record what vLLM's own tool-call and reasoning parsers make of the corpus (the oracle).

Runs under the vLLM venv (``.ci/vllm-env.sh`` builds it), never smgd's::

    $VLLM_PYTHON tests/parse_corpus/make_expected.py              # rewrites expected.json
    $VLLM_PYTHON tests/parse_corpus/make_expected.py OUT.json     # writes elsewhere

For every case in corpus.toml it builds vLLM's composed parser exactly as vLLM's chat server
does (``ParserManager.get_parser`` with auto tool choice, one parser object per request) and
records:

- ``nonstream``: ``Parser.parse(text)``, what a non-streaming response carries;
- ``streams``: the text cut into tokens (markup tokens whole, as a real tokenizer has them;
  other text in random 1-3 character pieces), grouped into deltas in a few ways (one token per
  delta, random groups, everything at once), each fed through ``Parser.parse_delta`` the way
  the server streams, and the deltas accumulated (content and reasoning concatenated, tool
  calls by index).

The tokenizer is a fake with the model family's special tokens in its vocabulary: vLLM's
parsers only ask a tokenizer for its vocabulary, its special tokens and single-token decodes.
Cut points are seeded by the case id, so a rerun on the same vLLM gives the same file.
"""

from __future__ import annotations

import importlib
import json
import logging
import random
import sys
import tomllib
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.toml"
EXPECTED = HERE / "expected.json"

# Markup tokens per model family: (every single-token markup string, the tokenizer's
# all_special_tokens). Only the second list is "special" to vLLM's engine parsers, which drop
# special tokens they do not know; the markup of Qwen/DeepSeek is added but not special.
FAMILIES: dict[str, tuple[list[str], list[str]]] = {
    "qwen": (
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
    ),
    "llama": (["<|python_tag|>", "<|eom_id|>"], ["<|begin_of_text|>", "<|eot_id|>"]),
    "mistral": (["[TOOL_CALLS]"], ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"]),
    "mistral_v11": (
        ["[TOOL_CALLS]", "[ARGS]"],
        ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]"],
    ),
    "deepseek": (
        [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<think>",
            "</think>",
        ],
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
    ),
}
DEFAULT_FAMILY = {
    "hermes": "qwen",
    "qwen3_coder": "qwen",
    "qwen3": "qwen",
    "llama3_json": "llama",
    "pythonic": "llama",
    "mistral": "mistral",
    "deepseek_v3": "deepseek",
    "deepseek_r1": "deepseek",
}
FIRST_SPECIAL_ID = 100_000  # ordinary text pieces get ids below, markup above
PROMPT_IDS = [11, 12, 13]  # a prompt with no markup: reasoning is open when output starts
RANDOM_SPLITS = 4  # plus one token per delta and everything in one delta


class FakeTokenizer:
    """The parts of a tokenizer vLLM's parsers touch: vocab, special tokens, decode."""

    def __init__(self, family: str) -> None:
        markup, special = FAMILIES[family]
        self.markup = sorted(set(markup) | set(special), key=len, reverse=True)
        self._vocab = {tok: FIRST_SPECIAL_ID + i for i, tok in enumerate(self.markup)}
        self._text: dict[int, str] = {i: t for t, i in self._vocab.items()}
        self.all_special_tokens = list(special)
        self.all_special_ids = [self._vocab[t] for t in special]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __len__(self) -> int:
        return FIRST_SPECIAL_ID + len(self.markup)

    def id_of(self, piece: str) -> int:
        found = self._vocab.get(piece)
        if found is None:
            found = 1000 + len(self._text)
            assert found < FIRST_SPECIAL_ID
            self._vocab[piece] = found
            self._text[found] = piece
        return found

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._text[i] for i in ids)

    def tokenize(self, text: str, rng: random.Random) -> list[str]:
        """Markup whole; other text in 1-3 character pieces that never straddle markup."""
        tokens: list[str] = []
        i = 0
        while i < len(text):
            hit = next((m for m in self.markup if text.startswith(m, i)), None)
            if hit is not None:
                tokens.append(hit)
                i += len(hit)
                continue
            end = min(len(text), i + rng.randint(1, 3))
            nxt = min((p for m in self.markup if (p := text.find(m, i + 1)) != -1), default=-1)
            if 0 < nxt < end:
                end = nxt
            tokens.append(text[i:end])
            i = end
        return tokens


def splits(tokens: list[str], rng: random.Random) -> list[list[list[str]]]:
    """Ways to group the tokens into deltas: one each, random groups, all at once."""
    out = [[[t] for t in tokens]]
    for _ in range(RANDOM_SPLITS):
        groups: list[list[str]] = []
        i = 0
        while i < len(tokens):
            n = rng.randint(1, 4)
            groups.append(tokens[i : i + n])
            i += n
        out.append(groups)
    out.append([tokens])
    return out


def call_dict(name: Any, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


class Oracle:
    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.manager = importlib.import_module("vllm.parser.parser_manager").ParserManager
        protocol = importlib.import_module("vllm.entrypoints.openai.chat_completion.protocol")
        self.request_cls = protocol.ChatCompletionRequest
        self.tools = tools

    def request(self) -> Any:
        return self.request_cls(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            tools=self.tools,
            tool_choice="auto",
        )

    def parser(self, case: dict[str, Any], tok: FakeTokenizer) -> tuple[Any, Any]:
        cls = self.manager.get_parser(
            tool_parser_name=case.get("tool"),
            reasoning_parser_name=case.get("reasoning"),
            enable_auto_tools=True,
            tokenizer=tok,
        )
        request = self.request()
        kwargs = {} if case.get("thinking", True) else {"enable_thinking": False}
        return cls(tok, request.tools, chat_template_kwargs=kwargs), request

    @staticmethod
    def prompt(case: dict[str, Any], tok: FakeTokenizer) -> list[int]:
        """The prompt's last tokens: with thinking off the template closed the block."""
        if case.get("thinking", True):
            return PROMPT_IDS
        return [*PROMPT_IDS, tok.id_of("<think>"), tok.id_of("\n\n"), tok.id_of("</think>")]

    def nonstream(self, case: dict[str, Any], tok: FakeTokenizer) -> dict[str, Any]:
        parser, request = self.parser(case, tok)
        parser.set_prompt_token_ids(self.prompt(case, tok))
        reasoning, content, calls = parser.parse(case["text"], request, enable_auto_tools=True)
        return {
            "content": content,
            "reasoning": reasoning,
            "tool_calls": [call_dict(c.name, c.arguments) for c in calls or []],
        }

    def stream(
        self, case: dict[str, Any], tok: FakeTokenizer, deltas: list[list[str]]
    ) -> dict[str, Any]:
        parser, request = self.parser(case, tok)
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        for n, delta in enumerate(deltas):
            msg = parser.parse_delta(
                "".join(delta),
                [tok.id_of(t) for t in delta],
                request,
                prompt_token_ids=self.prompt(case, tok),
                finished=n == len(deltas) - 1,
            )
            if msg is None:
                continue
            content.append(msg.content or "")
            reasoning.append(msg.reasoning or "")
            for tc in msg.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "head": None})
                fn = tc.function
                name = getattr(fn, "name", None) if fn is not None else None
                args = getattr(fn, "arguments", None) if fn is not None else None
                if slot["head"] is None:
                    # OpenAI's shape: the first delta of a call carries id, type and name.
                    slot["head"] = bool(tc.id) and tc.type == "function" and bool(name)
                slot["name"] += name or ""
                slot["arguments"] += args or ""
        return {
            "content": "".join(content) or None,
            "reasoning": "".join(reasoning) or None,
            "tool_calls": [
                {**call_dict(c["name"], c["arguments"]), "first_delta_has_id_type_name": c["head"]}
                for _, c in sorted(calls.items())
            ],
        }


def family_of(case: dict[str, Any]) -> str:
    if "vocab" in case:
        return str(case["vocab"])
    return DEFAULT_FAMILY[case.get("tool") or case["reasoning"]]


def record(corpus_path: Path) -> dict[str, Any]:
    corpus = tomllib.loads(corpus_path.read_text(encoding="utf-8"))
    oracle = Oracle(json.loads(corpus["tools"]))
    version = importlib.import_module("vllm").__version__
    cases: dict[str, Any] = {}
    for case in corpus["case"]:
        rng = random.Random(zlib.crc32(case["id"].encode()))
        family = family_of(case)
        tok = FakeTokenizer(family)
        tokens = tok.tokenize(case["text"], rng)
        cases[case["id"]] = {
            "nonstream": oracle.nonstream(case, tok),
            "streams": [
                {
                    "deltas": ["".join(d) for d in deltas],
                    "result": oracle.stream(case, tok, deltas),
                }
                for deltas in splits(tokens, rng)
            ],
        }
    return {
        "generated_by": "tests/parse_corpus/make_expected.py",
        "vllm": version,
        "cases": cases,
    }


def main() -> None:
    logging.disable(logging.CRITICAL)  # vLLM logs every malformed call with a traceback
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else EXPECTED
    text = json.dumps(record(CORPUS), ensure_ascii=False, indent=1, sort_keys=True) + "\n"
    out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
