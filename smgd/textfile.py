"""Reading a text file the configuration names: ``smgd.toml`` itself, a model's JSON files, a
chat template, a mock engine's script, an API keys file.

Each is UTF-8 whatever the locale (TOML and JSON are UTF-8 by their specs; a template or a
key file written on another host is not to be read in this one's encoding), and each way of
failing is a :class:`~smgd.errors.ConfigError` worded one way, at the key that named the file:
"cannot read X: <reason>", or "X is not UTF-8 text (byte N: 0xHH)" with the first bad byte,
which is what a user needs to find it in an editor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from smgd.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["read_utf8"]


def read_utf8(file: Path, *, what: str = "", key: str = "$", hint: str | None = None) -> str:
    """``file``'s text. ``what`` names the kind of file before its path in a message ("chat
    template "); ``key`` is the config key that named it; ``hint`` is given with a file that
    is not UTF-8. A missing file raises :class:`ConfigError` like any unreadable one."""
    try:
        return file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {what}{file}: {exc.strerror}", path=key) from None
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        raise ConfigError(
            f"{what}{file} is not UTF-8 text (byte {exc.start}: {bad:#04x})", path=key, hint=hint
        ) from None
