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
