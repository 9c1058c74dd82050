"""The config's text files are read one way (:mod:`smgd.textfile`): UTF-8 whatever the locale,
and a ConfigError at the key that named the file, with the first byte that is not UTF-8."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from smgd.config import Config, ServerConfig, load_api_keys, load_mock_script
from smgd.errors import ConfigError
from smgd.textfile import read_utf8

if TYPE_CHECKING:
    from pathlib import Path


def test_utf8_text_is_read_as_utf8_whatever_the_locale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LC_ALL", "C")  # (the encoding is never the locale's)
    path = tmp_path / "t"
    path.write_bytes("café ☕\n".encode())
    assert read_utf8(path) == "café ☕\n"


def test_the_first_byte_that_is_not_utf8_is_named_with_the_key_and_the_hint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t"
    path.write_bytes(b"ok\nnot \xff here \xfe")
    with pytest.raises(ConfigError) as info:
        read_utf8(path, what="chat template ", key="$.engines[0].chat_template", hint="save it")
    assert info.value.message == f"chat template {path} is not UTF-8 text (byte 7: 0xff)"
    assert (info.value.path, info.value.hint) == ("$.engines[0].chat_template", "save it")


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_an_unreadable_file_says_why_at_its_key(tmp_path: Path, make: str) -> None:
    path = tmp_path / "f"
    if make == "directory":
        path.mkdir()
    with pytest.raises(ConfigError) as info:
        read_utf8(path, what="mock script ", key="$.x")
    reason = "No such file or directory" if make == "missing" else "Is a directory"
    assert info.value.message == f"cannot read mock script {path}: {reason}"
    assert info.value.path == "$.x"


def test_an_api_keys_file_that_is_not_utf8_is_an_error_at_its_key(tmp_path: Path) -> None:
    (tmp_path / "keys").write_bytes(b"k1\nk\xe92\n")
    server = ServerConfig(api_keys_file="keys")
    with pytest.raises(ConfigError) as info:
        load_api_keys(Config(server=server, base_dir=str(tmp_path)), {})
    assert info.value.path == "$.server.api_keys_file"
    assert info.value.message.endswith("keys is not UTF-8 text (byte 4: 0xe9)")


def test_a_mock_script_that_is_not_utf8_names_its_byte(tmp_path: Path) -> None:
    path = tmp_path / "script.toml"
    path.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_mock_script(path)
    assert info.value.message == f"mock script {path} is not UTF-8 text (byte 5: 0xe9)"
