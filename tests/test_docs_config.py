"""Every config key is documented in the reference and mentioned in the default smgd.toml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from smgd.config import Config

ROOT = Path(__file__).resolve().parent.parent


def key_names(struct: Any, seen: set[str]) -> set[str]:
    for field in msgspec.structs.fields(struct):
        if field.name == "base_dir":
            continue
        seen.add(field.name)
        for candidate in (field.type, *getattr(field.type, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, msgspec.Struct):
                key_names(candidate, seen)
    return seen


KEYS = sorted(key_names(Config, set()))


@pytest.mark.parametrize("key", KEYS)
def test_key_in_reference(key: str) -> None:
    text = (ROOT / "docs/reference/config.md").read_text()
    assert f"`{key}`" in text or f"[{key}]" in text or f".{key}]" in text


@pytest.mark.parametrize("key", KEYS)
def test_key_in_default_config(key: str) -> None:
    assert key in (ROOT / "smgd.toml").read_text()


def _ranges(node: msgspec.inspect.Type, name: str, found: dict[str, set[str]]) -> None:
    """key name -> the range text config.md's type column gives (``0 ≤ x ≤ 86400``)."""

    def num(value: float | None) -> str:
        assert value is not None  # every number has both bounds (tests/test_config.py)
        return str(int(value)) if float(value).is_integer() else str(value)

    if isinstance(node, msgspec.inspect.UnionType):
        for inner in node.types:
            _ranges(inner, name, found)
    elif isinstance(node, msgspec.inspect.StructType):
        for field in node.fields:
            _ranges(field.type, field.name, found)
    elif isinstance(node, msgspec.inspect.ListType):
        _ranges(node.item_type, name, found)
    elif isinstance(node, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        low = f"{num(node.gt)} < x" if node.gt is not None else f"{num(node.ge)} ≤ x"
        found.setdefault(name, set()).add(f"{low} ≤ {num(node.le)}")


RANGES: dict[str, set[str]] = {}
_ranges(msgspec.inspect.type_info(Config), "", RANGES)


@pytest.mark.parametrize("key", sorted(RANGES))
def test_reference_gives_each_numbers_range(key: str) -> None:
    rows = [
        line
        for line in (ROOT / "docs/reference/config.md").read_text().splitlines()
        if line.startswith(f"| `{key}` |")
    ]
    assert rows, f"no row for {key}"
    for row in rows:
        assert any(f", {r} |" in row for r in RANGES[key]), f"{row!r} lacks {RANGES[key]}"
