"""smgd's tool-call and reasoning parsers against vLLM's own, run now (the oracle).

Needs the vLLM venv from ``.ci/vllm-env.sh``::

    set -a; eval "$(bash .ci/vllm-env.sh)"; set +a   # (exported: pytest runs it)
    .venv/bin/python -m pytest -m real_engine tests/real_engines/test_parse_oracle.py

make_expected.py runs vLLM 0.32's parsers (the composed parser its chat server builds, with
auto tool choice) over tests/parse_corpus/corpus.toml, non-streaming and streamed in six
token splits. The result must equal the committed expected.json (so the plain unit tests,
which check smgd against that file, test against what vLLM really does), and smgd must match
it case by case: vLLM's non-streaming result, or the case's `expect` where smgd differs on
purpose (the reason is named in the corpus and in docs/reference/parsers.md); streamed, the
same in every split, and vLLM's streamed result wherever vLLM's stream agrees with itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.parse_corpus import check

from .vllm_oracle import assert_unchanged, record

pytestmark = [pytest.mark.real_engine]

CORPUS = check.load()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return record(check.MAKE_EXPECTED, tmp_path_factory.mktemp("parse_oracle"))


def test_recording_is_current(fresh: dict[str, Any]) -> None:
    assert_unchanged(fresh, check.load_expected(), check.MAKE_EXPECTED)


@pytest.mark.parametrize("case", CORPUS.cases, ids=lambda c: c.id)
def test_smgd_matches_vllm(fresh: dict[str, Any], case: check.Case) -> None:
    errors = check.check(CORPUS, case, fresh["cases"][case.id])
    assert not errors, "\n".join(errors)
