"""Loading the corpus and checking smgd's parsers against a recording of vLLM's results.

Used by tests/test_parse_corpus.py (against the committed expected.json) and by
tests/real_engines/test_parse_oracle.py (against a fresh recording from vLLM itself).
"""

from __future__ import annotations

import itertools
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smgd.parse import Event, ToolCallDelta, collect, stream_parser

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.toml"
EXPECTED = HERE / "expected.json"
MAKE_EXPECTED = HERE / "make_expected.py"

# (content, reasoning, [(name, arguments)]): empty parts are None, arguments decoded when
# they are JSON (vLLM re-serialises what smgd streams as written), else the raw text.
Normal = tuple[str | None, str | None, list[tuple[str, Any]]]


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    tool: str | None
    reasoning: str | None
    thinking: bool
    differs: str | None
    expect: Normal | None
    vllm_stream: tuple[str, ...]


@dataclass(frozen=True)
class Corpus:
    tools: list[dict[str, Any]]
    cases: list[Case]
    smgd_differs: dict[str, str]  # reason key -> explanation
    vllm_stream: dict[str, str]


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def normal(content: str | None, reasoning: str | None, calls: list[tuple[str, str]]) -> Normal:
    return (content or None, reasoning or None, [(name, _args(args)) for name, args in calls])


def from_record(result: dict[str, Any]) -> Normal:
    calls = [(c["name"], c["arguments"]) for c in result["tool_calls"]]
    return normal(result["content"], result["reasoning"], calls)


def load() -> Corpus:
    data = tomllib.loads(CORPUS.read_text(encoding="utf-8"))
    cases = []
    for raw in data["case"]:
        expect = raw.get("expect")
        cases.append(
            Case(
                id=raw["id"],
                text=raw["text"],
                tool=raw.get("tool"),
                reasoning=raw.get("reasoning"),
                thinking=raw.get("thinking", True),
                differs=raw.get("differs"),
                expect=None
                if expect is None
                else normal(
                    expect.get("content"),
                    expect.get("reasoning"),
                    [(name, args) for name, args in expect.get("calls", [])],
                ),
                vllm_stream=tuple(raw.get("vllm_stream", ())),
            )
        )
    return Corpus(
        tools=json.loads(data["tools"]),
        cases=cases,
        smgd_differs=data["smgd_differs"],
        vllm_stream=data["vllm_stream"],
    )


def load_expected(path: Path = EXPECTED) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return result


def run(corpus: Corpus, case: Case, deltas: list[str]) -> list[Event]:
    """smgd's events for the output fed in these pieces (ids numbered, not random)."""
    ids = (f"call_{n}" for n in itertools.count())
    parser = stream_parser(
        tool=case.tool,
        reasoning=case.reasoning,
        tools=corpus.tools,
        thinking=case.thinking,
        new_id=lambda: next(ids),
    )
    events: list[Event] = []
    for delta in deltas:
        events += parser.feed(delta)
    return events + parser.finish()


def smgd_normal(events: list[Event]) -> Normal:
    parsed = collect(events)
    calls = [(c.name, c.arguments) for c in parsed.tool_calls]
    return normal(parsed.content, parsed.reasoning, calls)


def shape_errors(events: list[Event]) -> list[str]:
    """OpenAI's streaming shape: calls numbered 0, 1, ... in order; id and name on a call's
    first delta only."""
    errors = []
    seen = -1
    for event in events:
        if not isinstance(event, ToolCallDelta):
            continue
        first = event.index == seen + 1
        if event.index > seen + 1 or event.index < seen:
            errors.append(f"call index {event.index} after {seen}")
        if first != (event.id is not None and event.name is not None):
            errors.append(f"delta {event} (first of its call: {first})")
        seen = max(seen, event.index)
    return errors


def check(corpus: Corpus, case: Case, record: dict[str, Any]) -> list[str]:
    """Everything that must hold for one case; the failures, described."""
    errors: list[str] = []
    vllm = from_record(record["nonstream"])
    events = run(corpus, case, [case.text])
    ours = smgd_normal(events)
    errors += shape_errors(events)
    if case.differs is None:
        if ours != vllm:
            errors.append(f"non-streaming: smgd {ours!r} != vLLM {vllm!r}")
    else:
        if case.differs not in corpus.smgd_differs:
            errors.append(f"differs = {case.differs!r} is not in [smgd_differs]")
        if ours != case.expect:
            errors.append(f"non-streaming: smgd {ours!r} != expect {case.expect!r}")
        if ours == vllm:
            errors.append("smgd now equals vLLM: drop the `differs` mark")
    for key in case.vllm_stream:
        if key not in corpus.vllm_stream:
            errors.append(f"vllm_stream {key!r} is not in [vllm_stream]")
    vllm_consistent = True
    for n, stream in enumerate(record["streams"]):
        split = run(corpus, case, stream["deltas"])
        if smgd_normal(split) != ours:
            errors.append(f"split {n}: smgd streamed {smgd_normal(split)!r} != {ours!r}")
        errors += [f"split {n}: {e}" for e in shape_errors(split)]
        streamed = from_record(stream["result"])
        if streamed != vllm:
            vllm_consistent = False
            if not case.vllm_stream:
                errors.append(
                    f"split {n}: vLLM streamed {streamed!r}, not its non-streaming {vllm!r}: "
                    "say why with a vllm_stream reason"
                )
        elif case.differs is None and smgd_normal(split) != streamed:
            errors.append(f"split {n}: smgd streamed {smgd_normal(split)!r} != vLLM {streamed!r}")
    if case.vllm_stream and vllm_consistent:
        errors.append("vLLM's stream now matches its non-streaming result: drop vllm_stream")
    return errors
