"""smgd's parsers against vLLM 0.32's results for the corpus, as recorded in expected.json.

For every case: the non-streaming result equals vLLM's (or the case's `expect` where smgd
differs on purpose, with the reason named); streamed in each recorded token split it equals
the non-streamed result and, where vLLM's own stream is consistent, vLLM's streamed result.
The recording is made by tests/parse_corpus/make_expected.py; the real-engine oracle test
(tests/real_engines/test_parse_oracle.py) checks it is current.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parse_corpus import check

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference" / "parsers.md"

CORPUS = check.load()
EXPECTED = check.load_expected()


def test_recording_covers_the_corpus() -> None:
    assert EXPECTED["generated_by"] == "tests/parse_corpus/make_expected.py"
    assert sorted(EXPECTED["cases"]) == sorted(c.id for c in CORPUS.cases)
    assert len({c.id for c in CORPUS.cases}) == len(CORPUS.cases)


def test_every_reason_is_used() -> None:
    used_differs = {c.differs for c in CORPUS.cases}
    used_stream = {k for c in CORPUS.cases for k in c.vllm_stream}
    assert set(CORPUS.smgd_differs) == used_differs - {None}
    assert set(CORPUS.vllm_stream) == used_stream


def test_docs_list_every_reason() -> None:
    docs = DOCS.read_text(encoding="utf-8")
    for key in [*CORPUS.smgd_differs, *CORPUS.vllm_stream]:
        assert f"| `{key}` |" in docs, key


def test_corpus_covers_every_parser() -> None:
    from smgd.parse import REASONING_PARSERS, TOOL_PARSERS

    assert {c.tool for c in CORPUS.cases} - {None} == set(TOOL_PARSERS)
    assert {c.reasoning for c in CORPUS.cases} - {None} == set(REASONING_PARSERS)


@pytest.mark.parametrize("case", CORPUS.cases, ids=lambda c: c.id)
def test_case_matches_vllm(case: check.Case) -> None:
    errors = check.check(CORPUS, case, EXPECTED["cases"][case.id])
    assert not errors, "\n".join(errors)
