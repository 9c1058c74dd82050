"""smgd's chat template rendering against vLLM's chat server + transformers, run now (the oracle).

Needs the vLLM venv from ``.ci/vllm-env.sh``::

    set -a; eval "$(bash .ci/vllm-env.sh)"; set +a   # (exported: pytest runs it)
    .venv/bin/python -m pytest -m real_engine tests/real_engines/test_chat_oracle.py

tests/chat_corpus/make_expected.py renders every conversation of corpus.json through every
template in tests/chat_corpus/templates the way vLLM 0.32's /v1/chat/completions does (its
request model, its conversation builder, transformers' ``apply_chat_template``). The result
must equal the committed expected.json (so the plain unit tests, which check smgd against that
file, test against what vLLM and transformers really do), and smgd must render every case to
the same bytes, or refuse it where vLLM refuses it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.chat_corpus import check

from .vllm_oracle import assert_unchanged, record

pytestmark = [pytest.mark.real_engine]

CASES = check.load_cases()
TEMPLATES = check.template_names()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return record(check.MAKE_EXPECTED, tmp_path_factory.mktemp("chat_oracle"))


def test_recording_is_current(fresh: dict[str, Any]) -> None:
    assert_unchanged(fresh, check.load_expected(), check.MAKE_EXPECTED)


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_reading_matches_vllm(fresh: dict[str, Any], name: str) -> None:
    errors = check.check_template(name, fresh["templates"][name])
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_smgd_renders_as_vllm(fresh: dict[str, Any], case: check.Case, name: str) -> None:
    errors = check.check(case, name, fresh["cases"][case.id][name])
    assert not errors, "\n".join(errors)
