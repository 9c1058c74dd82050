"""smgd's chat template rendering against vLLM's chat server + transformers, run now (the oracle).

Needs the vLLM venv from ``.ci/vllm-env.sh``::

    eval "$(.ci/vllm-env.sh)"
    .venv/bin/python -m pytest -m real_engine tests/real_engines/test_chat_oracle.py

tests/chat_corpus/make_expected.py renders every conversation of corpus.json through every
template in tests/chat_corpus/templates the way vLLM 0.32's /v1/chat/completions does (its
request model, its conversation builder, transformers' ``apply_chat_template``). The result
must equal the committed expected.json (so the plain unit tests, which check smgd against that
file, test against what vLLM and transformers really do), and smgd must render every case to
the same bytes, or refuse it where vLLM refuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.chat_corpus import check

pytestmark = [pytest.mark.real_engine]

CASES = check.load_cases()
TEMPLATES = check.template_names()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        pytest.fail('VLLM_PYTHON unset: run `eval "$(.ci/vllm-env.sh)"` first')
    out = tmp_path_factory.mktemp("chat_oracle") / "expected.json"
    subprocess.run([python, str(check.MAKE_EXPECTED), str(out)], check=True, timeout=600)
    return check.load_expected(Path(out))


def test_recording_is_current(fresh: dict[str, object]) -> None:
    committed = check.load_expected()
    assert (fresh["vllm"], fresh["transformers"]) == (
        committed["vllm"],
        committed["transformers"],
    )
    assert fresh["templates"] == committed["templates"]
    changed = [
        cid
        for cid, record in fresh["cases"].items()  # type: ignore[attr-defined]
        if committed["cases"].get(cid) != record
    ]
    assert not changed, (
        f"vLLM renders {changed} differently now: rerun "
        "`$VLLM_PYTHON tests/chat_corpus/make_expected.py` and review the diff"
    )
    assert json.dumps(fresh, sort_keys=True) == json.dumps(committed, sort_keys=True)


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_reading_matches_vllm(fresh: dict[str, object], name: str) -> None:
    errors = check.check_template(name, fresh["templates"][name])  # type: ignore[index]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_smgd_renders_as_vllm(fresh: dict[str, object], case: check.Case, name: str) -> None:
    errors = check.check(case, name, fresh["cases"][case.id][name])  # type: ignore[index]
    assert not errors, "\n".join(errors)
