"""smgd's tool-call and reasoning parsers against vLLM's own, run now (the oracle).

Needs the vLLM venv from ``.ci/vllm-env.sh``::

    eval "$(.ci/vllm-env.sh)"
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

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.parse_corpus import check

pytestmark = [pytest.mark.real_engine]

CORPUS = check.load()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        pytest.fail('VLLM_PYTHON unset: run `eval "$(.ci/vllm-env.sh)"` first')
    out = tmp_path_factory.mktemp("oracle") / "expected.json"
    subprocess.run([python, str(check.MAKE_EXPECTED), str(out)], check=True, timeout=600)
    return check.load_expected(Path(out))


def test_recording_is_current(fresh: dict[str, object]) -> None:
    committed = check.load_expected()
    assert fresh["vllm"] == committed["vllm"]
    # case by case, so a failure names the cases vLLM now reads differently
    changed = [
        cid
        for cid, record in fresh["cases"].items()  # type: ignore[attr-defined]
        if committed["cases"].get(cid) != record
    ]
    assert not changed, (
        f"vLLM's results changed for {changed}: rerun "
        "`$VLLM_PYTHON tests/parse_corpus/make_expected.py` and review the diff"
    )
    assert json.dumps(fresh, sort_keys=True) == json.dumps(committed, sort_keys=True)


@pytest.mark.parametrize("case", CORPUS.cases, ids=lambda c: c.id)
def test_smgd_matches_vllm(fresh: dict[str, object], case: check.Case) -> None:
    errors = check.check(CORPUS, case, fresh["cases"][case.id])  # type: ignore[index]
    assert not errors, "\n".join(errors)
