"""docs/reference/faults.md names every case of the fault suite, and only cases that exist.

A reference is ``file.py::test_name`` (optionally with a parametrize id, ``[changed]``): a bare
file name is a file of ``tests/faults/``; one with a directory (``tests/test_balancer.py::...``)
is that path from the repository's root.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAULTS_MD = ROOT / "docs/reference/faults.md"
FAULTS_DIR = ROOT / "tests/faults"
# `dir/test_x.py::name` or `test_x.py::name`; the name is any identifier, so a misspelled one
# (``tset_...``) is read as a reference and reported as naming no test.
REFERENCE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*)(test_\w+\.py)::(\w+)")


def references(text: str) -> set[tuple[str, str]]:
    """(path from the repository's root, function name) of every reference in ``text``."""
    return {
        (f"{directory or 'tests/faults/'}{file}", name)
        for directory, file, name in REFERENCE.findall(text)
    }


def defined_tests(path: Path) -> set[str]:
    """Names of the module-level ``def test_*`` / ``async def test_*`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def fault_suite() -> set[tuple[str, str]]:
    """(path, name) of every test function of the fault suite."""
    return {
        (path.relative_to(ROOT).as_posix(), name)
        for path in sorted(FAULTS_DIR.glob("test_*.py"))
        for name in defined_tests(path)
    }


def test_the_parser_reads_references() -> None:
    text = (
        "| x | `test_reload.py::test_a[changed]`, `[removed]` |"
        " `tests/test_balancer.py::test_b` (slow) | `test_drain.py::tset_typo` |"
        " `file.py::test_name` | `test_engine_faults.py` |"
    )
    assert references(text) == {
        ("tests/faults/test_reload.py", "test_a"),
        ("tests/test_balancer.py", "test_b"),
        ("tests/faults/test_drain.py", "tset_typo"),
    }
    assert len(fault_suite()) > 50  # the suite was found (it held 59 tests when this was written)


def test_every_fault_case_has_a_row() -> None:
    documented = references(FAULTS_MD.read_text())
    missing = sorted(fault_suite() - documented)
    if missing:
        listed = "\n".join(f"  {Path(path).name}::{name}" for path, name in missing)
        pytest.fail(
            f"{len(missing)} fault-suite test(s) named nowhere in docs/reference/faults.md; add a "
            f"row for each (fault | what the client sees | then | `file.py::test_name`) to "
            f"docs/reference/faults.md:\n{listed}",
            pytrace=False,
        )


def test_every_row_names_a_test_that_exists() -> None:
    stale = []
    for path, name in sorted(references(FAULTS_MD.read_text())):
        file = ROOT / path
        if not file.is_file() or name not in defined_tests(file):
            stale.append(f"  {path}::{name}")
    if stale:
        listed = "\n".join(stale)
        pytest.fail(
            f"docs/reference/faults.md names {len(stale)} test(s) that do not exist (renamed, "
            f"removed or misspelled; a test outside tests/faults/ is named with its directory, "
            f"`tests/test_x.py::test_name`):\n{listed}",
            pytrace=False,
        )
