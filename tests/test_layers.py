"""The layering of docs/design.md ("Layers"), checked on every import of every smgd module.

Each module sits in one layer (:data:`LAYERS`). A module imports only from its own layer or
from lower ones: never upward, whether the import is at module level, inside a function or
under ``TYPE_CHECKING``. And no import cycle between smgd modules, in any of those forms.

Imports are read with :mod:`ast`, nothing is imported. A module that is in no layer fails
the test: a new module must be placed. :data:`ALLOWED` lists the edges that break the rules
today and are being removed on other branches; an entry that no longer exists in the code
fails too, so the list only shrinks.

The gateway's fields each have one writer, named in :mod:`smgd.gateway` by a ``# ---- written
by <module>`` line above them; the last tests read those lines and find every assignment to
(or mutating call on) a gateway field anywhere in smgd, and its module must be the owner.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import smgd
from smgd.gateway import Gateway

PACKAGE = Path(smgd.__file__).parent

# Low -> high. An entry is a module (``smgd.router``) or every module under a package
# (``smgd.wire.*``; the package itself is listed on its own when it has an ``__init__``).
LAYERS: list[tuple[str, list[str]]] = [
    (
        "L0 leaves",
        [
            "smgd",  # __version__
            "smgd.errors",
            "smgd.config",
            "smgd.logs",
            "smgd.sdnotify",  # with the watchdog task
            "smgd.assets",
            "smgd.assets.*",
            "smgd.wire",
            "smgd.wire.*",
            "smgd.text",
            "smgd.text.*",
            "smgd.parse",
            "smgd.parse.*",
            "smgd.sampling",
            "smgd.worker_id",  # Worker, current_worker, for_worker
            "smgd.limits",  # the open-files limit
            "smgd.linelog",  # the log budget of an engine's output lines
            "smgd.gc_tuning",  # the collector's thresholds (daemon and mock engine)
            "smgd.textfile",  # the config's text files, read one way
            # LAYERS.md has it in L1; config validates socket paths with its SUN_PATH_MAX,
            # and it imports nothing but errors, so it is a leaf.
            "smgd.ipc",
        ],
    ),
    (
        "L1 transport",
        [
            "smgd.zmq_trio",
            "smgd.launch",
            "smgd.launchers",
            "smgd.launchers.*",
            "smgd.admission",
            # LAYERS.md has it in L7; the api's /metrics, /readiness and /get_load ask the
            # other workers through it, and it needs nothing but worker_id: unix-socket
            # transport between workers plus pure merges.
            "smgd.worker_peers",
        ],
    ),
    (
        "L2 engines",
        [
            "smgd.engines",
            "smgd.engines.*",
            "smgd.router",
        ],
    ),
    (
        "L3 supervision",
        [
            "smgd.supervise",  # launch, watch, relaunch, apply a reload
            "smgd.reload",  # the reload's plan (pure)
            "smgd.gateway",
            "smgd.metrics",  # reads the gateway at scrape time
        ],
    ),
    (
        "L4 api core",
        [
            "smgd.api",
            "smgd.api.core",
            "smgd.api.core.*",
        ],
    ),
    (
        "L5 api handlers",
        [
            "smgd.api.handlers",
            "smgd.api.handlers.*",
        ],
    ),
    (
        "L6 api http",
        [
            "smgd.api.http",
            "smgd.api.http.*",
        ],
    ),
    (
        "L7 top",
        [
            "smgd.daemon",
            "smgd.workers",
            "smgd.status",
            "smgd.cli",
            "smgd.__main__",
            "smgd.bench",
            "smgd.bench.*",
            "smgd.mock",  # a separate program: see test_only_the_cli_and_bench_import_the_mock
            "smgd.mock.*",
        ],
    ),
]

# Imports that break a rule today, each removed by a branch in flight. Keep the reason.
ALLOWED: dict[tuple[str, str], str] = {}

# Who may import the mock engine (a separate program) besides itself.
MOCK_IMPORTERS = ("smgd.cli", "smgd.bench")


# --------------------------------------------------------------------------- reading imports


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    where: str  # "module", "function" or "TYPE_CHECKING"

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported} ({self.where})"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name (``pkg.sub.mod``)."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: set[str]) -> Iterator[Import]:
    """Every import of a module of ``modules`` in the file, where it is and what it names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))

    def target(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])

    def walk(node: ast.AST, where: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = "function"
            elif (
                isinstance(child, ast.If)
                and where == "module"
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                inner = "TYPE_CHECKING"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name in modules:
                        yield Import(name, alias.name, child.lineno, inner)
            elif isinstance(child, ast.ImportFrom):
                source = target(child)
                for alias in child.names:
                    # `from pkg import mod` imports the module; `from mod import name` the module.
                    full = f"{source}.{alias.name}"
                    imported = full if full in modules else source
                    if imported in modules:
                        yield Import(name, imported, child.lineno, inner)
            yield from walk(child, inner)

    yield from walk(tree, "module")


def all_imports(root: Path) -> list[Import]:
    modules = module_names(root)
    found = [imp for name, path in modules.items() for imp in imports_of(name, path, set(modules))]
    return [imp for imp in found if imp.imported != imp.importer]


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The index of the layer that names ``module`` (exactly, else the longest ``pkg.*``)."""
    best: tuple[int, int] | None = None  # (length of the matching pattern, layer)
    for index, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if pattern == module:
                return index
            matches = pattern.endswith(".*") and module.startswith(pattern[:-1])
            if matches and (best is None or len(pattern) > best[0]):
                best = (len(pattern), index)
    return None if best is None else best[1]


# --------------------------------------------------------------------------- the rules


def unplaced(root: Path, layers: list[tuple[str, list[str]]]) -> list[str]:
    return [name for name in module_names(root) if layer_of(name, layers) is None]


def upward(
    imports: list[Import],
    layers: list[tuple[str, list[str]]],
    allowed: dict[tuple[str, str], str],
) -> list[str]:
    """Every import of a higher layer's module, with both layers named."""
    found = []
    for imp in imports:
        if (imp.importer, imp.imported) in allowed:
            continue
        low, high = layer_of(imp.importer, layers), layer_of(imp.imported, layers)
        if low is not None and high is not None and high > low:
            found.append(f"{imp} [{layers[low][0]} -> {layers[high][0]}]")
    return found


def cycles(imports: list[Import], allowed: dict[tuple[str, str], str]) -> list[list[str]]:
    """Every import cycle (a strongly connected set of modules, Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if (imp.importer, imp.imported) not in allowed:
            graph.setdefault(imp.importer, set()).add(imp.imported)
            graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the module count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


# --------------------------------------------------------------------------- smgd itself


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return all_imports(PACKAGE)


def test_every_module_is_in_a_layer() -> None:
    missing = unplaced(PACKAGE, LAYERS)
    assert not missing, f"place these modules in a layer of LAYERS (and docs/design.md): {missing}"


def test_no_module_imports_a_higher_layer(imports: list[Import]) -> None:
    assert upward(imports, LAYERS, ALLOWED) == []


def test_no_import_cycle(imports: list[Import]) -> None:
    assert cycles(imports, ALLOWED) == []


def test_every_allowed_exception_still_exists(imports: list[Import]) -> None:
    """An entry of ALLOWED whose import is gone must leave the list."""
    edges = {(imp.importer, imp.imported) for imp in imports}
    assert [edge for edge in ALLOWED if edge not in edges] == []


def test_only_the_cli_and_bench_import_the_mock(imports: list[Import]) -> None:
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    wrong = [
        str(imp)
        for imp in imports
        if inside(imp.imported, "smgd.mock")
        and not inside(imp.importer, "smgd.mock")
        and not any(inside(imp.importer, ok) for ok in MOCK_IMPORTERS)
    ]
    assert wrong == []


def test_no_function_level_import_goes_up(imports: list[Import]) -> None:
    """The old circle was held together by imports inside functions: none goes up a layer,
    and none is excused by ALLOWED."""
    function_level = [imp for imp in imports if imp.where == "function"]
    assert upward(function_level, LAYERS, {}) == []


def test_the_design_page_draws_the_same_layers() -> None:
    """docs/design.md's "Layers" table names the same modules in the same layers."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    drawn: dict[str, set[str]] = {}
    for row in section.splitlines():
        cells = row.split("|")
        if len(cells) > 3 and re.match(r" L\d ", cells[1]):
            names: set[str] = set()
            for token in re.findall(r"`([\w/*]+)`", cells[2]):
                dotted = "smgd." + token.replace("/", ".")
                names |= {dotted, dotted[:-2]} if dotted.endswith(".*") else {dotted}
            drawn[cells[1].strip()] = names
    # The test also places the package roots and, until the api split lands, the flat api
    # modules the page does not draw.
    legacy = {"smgd", "smgd.api"} | {
        m for _, mods in LAYERS for m in mods if re.fullmatch(r"smgd\.api\.\w+", m)
    } - {"smgd.api.core", "smgd.api.handlers", "smgd.api.http"}
    tested = {name: set(mods) - legacy for name, mods in LAYERS}
    assert drawn == tested


# --------------------------------------------------------------------------- the checker itself


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


TOY_LAYERS = [("low", ["pkg", "pkg.low", "pkg.sub.*"]), ("high", ["pkg.high", "pkg.other"])]


@pytest.mark.parametrize(
    "source",
    [
        "from pkg.high import x\n",
        "import pkg.high\n",
        "from pkg import high\n",
        "from . import high\n",
        "from .high import x\n",
        "def f():\n    from pkg.high import x\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import X\n",
        "class C:\n    def m(self):\n        import pkg.high\n",
    ],
)
def test_the_checker_finds_a_planted_upward_import(tmp_path: Path, source: str) -> None:
    root = _package(tmp_path, {"low.py": source, "high.py": "from pkg.low import y\n"})
    found = upward(all_imports(root), TOY_LAYERS, {})
    assert len(found) == 1 and found[0].startswith("pkg.low:") and "pkg.high" in found[0]
    # Downward and same-layer imports are fine; an allowed edge is not reported.
    assert upward(all_imports(root), TOY_LAYERS, {("pkg.low", "pkg.high"): "why"}) == []


def test_the_checker_finds_a_planted_cycle(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "high.py": "from pkg.other import a\n",
            "other.py": "def f():\n    from pkg.high import b\n",  # hidden in a function
            "low.py": "",
            "sub/__init__.py": "",
            "sub/x.py": "from pkg.sub.y import c\n",
            "sub/y.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.sub.x\n",
        },
    )
    assert cycles(all_imports(root), {}) == [["pkg.high", "pkg.other"], ["pkg.sub.x", "pkg.sub.y"]]
    allowed = {("pkg.other", "pkg.high"): "why"}
    assert cycles(all_imports(root), allowed) == [["pkg.sub.x", "pkg.sub.y"]]
    assert upward(all_imports(root), TOY_LAYERS, {}) == []


def test_the_checker_finds_an_unplaced_module(tmp_path: Path) -> None:
    root = _package(tmp_path, {"low.py": "", "high.py": "", "new.py": "", "sub/z.py": ""})
    assert unplaced(root, TOY_LAYERS) == ["pkg.new"]  # pkg.sub.z is under pkg.sub.*


# --------------------------------------------------------------------------- gateway ownership

# Calls that change the object they are called on (a trio.Event's set, a list's append, the
# router's put/remove): on a gateway field they count as writing it.
MUTATORS = frozenset(
    {"set", "append", "extend", "insert", "put", "remove", "pop", "clear", "update", "add"}
)
# Gateway methods that write fields, by who may call them.
GATEWAY_WRITERS = {"apply_config": "smgd.supervise"}


def gateway_owners(source: str) -> dict[str, str]:
    """Field -> owning module, from the ``# ---- written by ...`` lines of class Gateway."""
    owners: dict[str, str] = {}
    owner = None
    inside = False
    for line in source.splitlines():
        if line.startswith("class "):
            inside = line.startswith("class Gateway")
            continue
        if not inside:
            continue
        if match := re.match(r"    # ---- written by .*?\b(smgd(?:\.\w+)*)", line):
            owner = match.group(1)
        elif (match := re.match(r"    (\w+): ", line)) and owner is not None:
            owners[match.group(1)] = owner
    return owners


def _is_gateway(node: ast.expr) -> bool:
    """``gateway``, ``self.gateway``, ``ctx.gateway``, ``api().gateway``..."""
    if isinstance(node, ast.Name):
        return node.id.endswith("gateway")
    return isinstance(node, ast.Attribute) and node.attr.endswith("gateway")


def _field(node: ast.expr) -> str | None:
    """The gateway field an expression that is written to belongs to (``gateway.f``,
    ``gateway.f.x``, ``gateway.f[k]``...), or None."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and _is_gateway(node.value):
            return node.attr
        node = node.value
    return None


def gateway_writes(source: str) -> Iterator[tuple[str, int, str]]:
    """(field or method, line, what) for every write to a gateway field in ``source``."""
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (name := _field(leaf)) is not None:
                    yield name, target.lineno, "assigned"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in MUTATORS and (name := _field(node.func.value)) is not None:
                yield name, node.lineno, f"{method}()"
            if method in GATEWAY_WRITERS and _is_gateway(node.func.value):
                yield method, node.lineno, "called"


def wrong_writers(sources: dict[str, str], owners: dict[str, str]) -> list[str]:
    """Every write to a gateway field from a module that does not own it."""

    def owns(module: str, owner: str) -> bool:
        return module == owner or module.startswith(owner + ".") or module == "smgd.gateway"

    wrong = []
    for module, source in sources.items():
        for name, line, what in gateway_writes(source):
            owner = owners.get(name) or GATEWAY_WRITERS.get(name)
            if owner is None:
                continue  # not a field (a method that only reads, a local name)
            if not owns(module, owner):
                wrong.append(f"{module}:{line}: gateway.{name} {what}, owned by {owner}")
    return wrong


def test_every_gateway_field_has_one_documented_owner() -> None:
    owners = gateway_owners((PACKAGE / "gateway.py").read_text())
    fields = {f.name for f in dataclasses.fields(Gateway)}
    assert set(owners) == fields
    assert set(owners.values()) == {"smgd.supervise", "smgd.daemon", "smgd.api"}


def test_only_its_owner_writes_a_gateway_field() -> None:
    owners = gateway_owners((PACKAGE / "gateway.py").read_text())
    sources = {name: path.read_text() for name, path in module_names(PACKAGE).items()}
    assert wrong_writers(sources, owners) == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("def f(gateway):\n    gateway.draining = True\n", "gateway.draining assigned"),
        ("def f(ctx):\n    ctx.gateway.drain_event.set()\n", "gateway.drain_event set()"),
        ("def f(self):\n    self.gateway.reloads_total += 1\n", "gateway.reloads_total assigned"),
        ("def f(gateway):\n    gateway.engine_restarts['e'] = 1\n", "engine_restarts assigned"),
        ("def f(gateway):\n    gateway.router.routing = None\n", "gateway.router assigned"),
        ("def f(gateway, c):\n    gateway.router.put(c)\n", "gateway.router put()"),
        ("def f(gateway, c, t):\n    gateway.apply_config(c, t)\n", "apply_config called"),
    ],
)
def test_the_owner_check_finds_a_planted_write(source: str, found: str) -> None:
    owners = gateway_owners((PACKAGE / "gateway.py").read_text())
    (wrong,) = wrong_writers({"smgd.api.planted": source}, owners)
    assert found in wrong
    # Reads are not writes.
    reads = "def f(gateway):\n    x = gateway.draining\n    gateway.router.get('e')\n"
    assert wrong_writers({"smgd.api.planted": reads}, owners) == []
