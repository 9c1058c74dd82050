"""What one benchmark run offers: the workload knobs and the exact prompt every stream sends.

The prompt is ``P`` token ids of text from the model's own tokenizer, with no special ids, so
the mock engine (which echoes the prompt cyclically, skipping special ids) produces a known
output: :class:`Prompt` carries the expected ids, text and per-token prefix lengths that the
lost/duplicated-token check compares against.

The vocabulary (``--vocab``): ``tiny``, the packaged 1k-token model with plain English (vLLM's
front end reads ``VLLM_MODEL``'s); or ``128k``, a 128k-token byte-level BPE built offline
(:mod:`smgd.assets.vocab128k`), the same for every target, with real text whose tokens are
long, multi-byte, or end inside a character.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from smgd.bench.stats import prefix_lengths

if TYPE_CHECKING:
    from pathlib import Path

VOCABS = ("tiny", "128k")

_TEXT = (
    "The quick brown fox jumps over the lazy dog while the early bird catches the worm, "
    "and a stitch in time saves nine when every cloud has a silver lining. "
)
_REPLACEMENT = "\ufffd"  # what decode() makes of an incomplete UTF-8 character
# How long one request may take beyond its ideal time before the hard limit fires: generous,
# because the point of the limit is to bound a hung run, not to judge latency.
_TIME_LIMIT_SLACK = 3.0
_TIME_LIMIT_FLOOR_S = 30.0


@dataclass(frozen=True, slots=True)
class Workload:
    step_ms: float = 20.0
    max_batch: int = 256
    prompt_tokens: int = 64
    max_tokens: int = 128
    duration_s: float = 10.0
    vocab: str = "tiny"  # one of VOCABS
    # Every request on a connection of its own (a client without a connection pool: curl,
    # scripts): what a connection costs the front end, beside what a request does.
    new_connections: bool = False

    def model_dir(self) -> Path | None:
        """The model dir every target uses for this vocabulary (building the 128k one on first
        use); None for ``tiny``, where each target keeps its own (smgd's packaged model,
        vLLM's ``VLLM_MODEL``)."""
        if self.vocab == "tiny":
            return None
        from smgd.assets import vocab128k

        return vocab128k.model_dir()

    def prompt_text(self) -> str:
        """The text the prompt is cut from."""
        if self.vocab == "tiny":
            return _TEXT
        from smgd.assets import vocab128k

        return vocab128k.SAMPLE_TEXT

    def mock_args(self, skip_ids: str) -> list[str]:
        """The mock engine's flags for this workload (step time, batch, never-echoed ids)."""
        return [
            "--step-ms", str(self.step_ms),
            "--max-batch", str(self.max_batch),
            "--skip-ids", skip_ids,
        ]  # fmt: skip

    def offered_tokens_per_s(self, concurrency: int) -> float:
        """What the engine can produce for C streams: one token per running stream per step."""
        return min(concurrency, self.max_batch) * 1000.0 / self.step_ms

    def request_s(self, concurrency: int) -> float:
        """Ideal time of one request at C in flight (queueing when C exceeds the batch)."""
        waves = math.ceil(concurrency / self.max_batch)
        return waves * self.max_tokens * self.step_ms / 1000.0

    def max_requests(self, concurrency: int) -> int:
        """A count bound just above what the duration allows, so both bounds hold."""
        per_stream = math.ceil(self.duration_s / self.request_s(concurrency)) + 1
        return concurrency * per_stream

    def time_limit_s(self, concurrency: int) -> float:
        ideal = self.duration_s + self.request_s(concurrency)
        return max(_TIME_LIMIT_FLOOR_S, ideal * _TIME_LIMIT_SLACK)


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    expected_ids: list[int]
    expected_text: str
    prefix_lens: list[int]


def build_prompt(
    model_dir: str | Path, prompt_tokens: int, max_tokens: int, text: str = _TEXT
) -> Prompt:
    """``prompt_tokens`` ids of ``text`` and the echo the mock engine will stream back.

    A token may end inside a UTF-8 character; the window is placed so that the prompt and the
    echo start and end on character boundaries (a stream never ends with a held-back byte),
    and such a token's text piece is empty (the character comes with the token completing it).
    """
    from smgd.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    specials = tok.special_ids
    source = text
    ids: list[int] = []
    while len(ids) < 2 * prompt_tokens:
        ids = [t for t in tok.encode(source, add_special_tokens=False) if t not in specials]
        source += text

    def echo(start: int) -> list[int]:
        window = ids[start : start + prompt_tokens]
        return [window[i % len(window)] for i in range(max_tokens)]

    start = next(
        (
            i
            for i in range(len(ids) - prompt_tokens + 1)
            if _REPLACEMENT not in tok.decode(ids[i : i + prompt_tokens])
            and _REPLACEMENT not in tok.decode(echo(i))
        ),
        None,
    )
    if start is None:
        raise ValueError("no window of the text starts and ends on character boundaries")
    expected = echo(start)
    pieces: list[str] = []
    emitted = ""
    for k in range(1, max_tokens + 1):
        cur = tok.decode(expected[:k])
        if cur.endswith(_REPLACEMENT):  # held back until the character is complete
            pieces.append("")
            continue
        if not cur.startswith(emitted):
            raise ValueError("prompt tokens do not decode to clean per-token text pieces")
        pieces.append(cur[len(emitted) :])
        emitted = cur
    full = tok.decode(expected)
    if "".join(pieces) != full:
        raise ValueError("prompt tokens do not decode to clean per-token text pieces")
    return Prompt(
        ids=ids[start : start + prompt_tokens],
        expected_ids=expected,
        expected_text=full,
        prefix_lens=prefix_lengths(pieces),
    )


# The tools workload's model output: a reasoning block, then one hermes call with string
# arguments, as Qwen3 writes them. ASCII only, so every token decodes to a clean text piece.
_TOOL_NAME = "search_flights"
_THINK = (
    "The user wants a flight from Paris to Tokyo next week, so I should search for one "
    "with the dates and the preferences they gave, then compare the fares."
)
_QUERY = (
    "window seat vegetarian meal one checked bag morning departure no overnight layover "
    "refundable fare lounge access"
)
TOOL_PARSER = "hermes"
REASONING_PARSER = "qwen3"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _TOOL_NAME,
            "description": "Search flights between two cities.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                    "query": {"type": "string"},
                },
                "required": ["origin", "destination"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "Find me a flight from Paris to Tokyo next week."}]


@dataclass(frozen=True, slots=True)
class ToolPrompt:
    """The tools workload: the scripted reply and what each stream must accumulate to.

    ``expected_text`` is the stream flattened: ``reasoning_content``, then ``content``, then
    each call's name and arguments in index order; ``prefix_lens`` the flattened length after
    each reply token and the EOS (markup tokens add nothing), for the lost/duplicated count.
    Without ``parsers`` (the engine has none: the control) the whole reply is ``content``.
    """

    reply: str
    reply_tokens: int  # the reply's tokens plus the EOS the mock ends it with
    reasoning: str
    calls: list[tuple[str, str]]  # (name, arguments JSON)
    expected_text: str
    prefix_lens: list[int]
    parsers: bool = True

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.parsers else "stop"

    def script(self) -> str:
        """The mock's ``[engines.mock] script``: this reply to every prompt."""
        return f"[[reply]]\ntext = '''{self.reply}'''\n"


def _tool_reply(think_words: int, query_words: int) -> tuple[str, str, str]:
    """(reply, expected reasoning, expected arguments) with that many filler words."""
    import json

    think, more = _THINK.split(), _QUERY.split()
    body = " ".join(think[i % len(think)] for i in range(think_words))
    query = " ".join(more[i % len(more)] for i in range(query_words))
    args = json.dumps({"origin": "Paris", "destination": "Tokyo", "date": "2026-12-24",
                       "query": query})  # fmt: skip
    call = json.dumps({"name": _TOOL_NAME, "arguments": json.loads(args)})
    reply = f"<think>\n{body}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    # Qwen3's reasoning parser keeps the newlines inside the block, as vLLM's does.
    return reply, f"\n{body}\n", args


def build_tool_prompt(model_dir: str | Path, max_tokens: int, parsers: bool = True) -> ToolPrompt:
    """A reply of about ``max_tokens`` tokens (at least the markup's), half reasoning, half
    arguments, and its expected stream, checked against smgd's own parsers token by token
    (without ``parsers``: the reply as plain content, each token its decoded piece)."""
    from smgd.parse import ContentDelta, ReasoningDelta, stream_parser
    from smgd.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    words = 1
    reply, reasoning, args = _tool_reply(words, words)
    ids = tok.encode(reply, add_special_tokens=False)
    while len(ids) + 1 < max_tokens:
        words += 1
        reply, reasoning, args = _tool_reply(words, words)
        ids = tok.encode(reply, add_special_tokens=False)
    expected = reasoning + _TOOL_NAME + args if parsers else reply
    tool, reasoning_parser = (TOOL_PARSER, REASONING_PARSER) if parsers else (None, None)
    parser = stream_parser(tool=tool, reasoning=reasoning_parser, tools=TOOLS)
    lens: list[int] = []
    total = 0
    prev = ""
    for k in range(1, len(ids) + 2):
        piece = ""
        if k <= len(ids):
            cur = tok.decode(ids[:k])
            piece, prev = cur[len(prev) :], cur
        events = parser.feed(piece) if piece else parser.finish()
        for event in events:
            if isinstance(event, (ContentDelta, ReasoningDelta)):
                total += len(event.text)
            else:
                total += len(event.name or "") + len(event.arguments)
        lens.append(total)
    if prev != reply or total != len(expected):
        raise ValueError("the tool reply does not parse to its expected reasoning and call")
    return ToolPrompt(
        reply=reply,
        reply_tokens=len(ids) + 1,
        reasoning=reasoning,
        calls=[(_TOOL_NAME, args)],
        expected_text=expected,
        prefix_lens=lens,
        parsers=parsers,
    )
