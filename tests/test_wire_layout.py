"""smgd/wire/ stays a leaf split by role: every import of a wire name names the module that
defines it (no re-export shims), and wire modules import nothing of smgd but errors and wire."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _module_path(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _defined_names(path: Path) -> set[str]:
    """Top-level names a module binds itself (def, class, assignment), not by import."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _wire_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) for every ``from smgd.wire... import name`` in a file."""
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smgd.wire"):
            found.extend((node.lineno, node.module or "", a.name) for a in node.names)
    return found


def _python_files() -> list[Path]:
    return sorted([*REPO.joinpath("smgd").rglob("*.py"), *REPO.joinpath("tests").rglob("*.py")])


def test_every_wire_name_is_imported_from_the_module_that_defines_it() -> None:
    bad = []
    for path in _python_files():
        for line, module, name in _wire_imports(path):
            if _module_path(f"{module}.{name}") is not None:
                continue  # a submodule: ``from smgd.wire.vllm import jsonform``
            source = _module_path(module)
            if source is None or name not in _defined_names(source):
                bad.append(f"{path.relative_to(REPO)}:{line}: {name} is not defined in {module}")
    assert not bad, "\n".join(bad)


def test_wire_modules_import_only_errors_and_wire() -> None:
    bad = []
    for path in sorted(REPO.joinpath("smgd", "wire").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                if module.startswith("smgd") and not (
                    module == "smgd.errors" or module.startswith("smgd.wire")
                ):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {module}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_the_codecs() -> None:
    # Guards the two tests above against passing vacuously (no files, no wire imports found).
    imports = [i for p in _python_files() for i in _wire_imports(p)]
    assert ("smgd.wire.sglang.decode", "decode_output") in {(m, n) for _, m, n in imports}
    assert "decode_outputs" in _defined_names(REPO / "smgd/wire/vllm/decode.py")
    assert "Frame" in _defined_names(REPO / "smgd/wire/vllm/structs.py")
