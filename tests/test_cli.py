"""The command line outside a checkout: the built-in default, `smgd init`, JSON-only logging."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from smgd.assets import DEFAULT_CONFIG
from smgd.cli import main
from smgd.config import LoggingConfig
from smgd.logs import announce, flush_logs, setup_logging


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cwd with no smgd.toml and no $SMGD_CONFIG."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMGD_CONFIG", raising=False)
    return tmp_path


def test_check_config_without_a_file_uses_the_builtin_default(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config"]) == 0
    out, err = capsys.readouterr()
    resolved = json.loads(out)
    assert resolved["engines"][0]["model_dir"] == "builtin:tiny-model"
    assert resolved["base_dir"] == str(DEFAULT_CONFIG.parent)
    assert "built-in default" in err and str(DEFAULT_CONFIG) in err


def test_a_local_smgd_toml_wins_over_the_builtin(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (elsewhere / "smgd.toml").write_text(
        DEFAULT_CONFIG.read_text().replace("port = 8080", "port = 8181")
    )
    assert main(["check-config"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["server"]["port"] == 8181
    assert "built-in default" not in err


def test_a_named_file_that_is_missing_is_an_error(
    elsewhere: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only "no config named anywhere" falls back; a named file that is gone is a mistake.
    monkeypatch.setenv("SMGD_CONFIG", str(elsewhere / "gone.toml"))
    assert main(["check-config"]) == 2
    assert "gone.toml" in capsys.readouterr().err


def test_init_writes_the_default_and_refuses_to_overwrite(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["init"]) == 0
    written = elsewhere / "smgd.toml"
    assert written.read_text() == DEFAULT_CONFIG.read_text()
    assert "wrote smgd.toml" in capsys.readouterr().err
    written.write_text("# mine\n")
    assert main(["init"]) == 1
    assert "--force" in capsys.readouterr().err
    assert written.read_text() == "# mine\n"  # untouched
    assert main(["init", "--force"]) == 0
    assert written.read_text() == DEFAULT_CONFIG.read_text()
    assert main(["check-config"]) == 0  # what init wrote is valid where it was written


def test_init_into_a_directory_and_a_path(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (elsewhere / "etc").mkdir()
    assert main(["init", "etc"]) == 0
    assert (elsewhere / "etc/smgd.toml").read_text() == DEFAULT_CONFIG.read_text()
    assert "smgd serve -c etc/smgd.toml" in capsys.readouterr().err
    assert main(["init", "other.toml"]) == 0
    assert (elsewhere / "other.toml").is_file()
    assert main(["init", "no/such/dir/x.toml"]) == 1
    assert "cannot write" in capsys.readouterr().err


def test_check_config_as_a_process_from_another_directory(tmp_path: Path) -> None:
    # As a user runs it after `pip install .`: a fresh interpreter, a cwd outside the checkout.
    env = {k: v for k, v in os.environ.items() if k != "SMGD_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-m", "smgd", "check-config"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("ok: 1 engine(s)")


def test_packaged_data_is_declared() -> None:
    # pyproject's package-data globs must ship the default config and the tiny model.
    root = Path(__file__).resolve().parent.parent
    text = (root / "pyproject.toml").read_text()
    assert '"assets/**/*"' in text
    assert DEFAULT_CONFIG.is_relative_to(root / "smgd/assets")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    setup_logging(LoggingConfig())  # announce() back to plain lines
    root.handlers[:] = handlers
    root.setLevel(level)


def test_announce_is_json_in_json_mode(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging(LoggingConfig(format="json"))
    announce("smgd listening on http://127.0.0.1:1", url="http://127.0.0.1:1")
    announce("smgd: boom", level=logging.ERROR)
    assert flush_logs()  # the writer thread wrote them
    lines = capsys.readouterr().err.splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["msg"] == "smgd listening on http://127.0.0.1:1"
    assert records[0]["url"] == "http://127.0.0.1:1"
    assert records[1]["level"] == "error"


def test_announce_is_a_plain_line_in_human_mode(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging(LoggingConfig(format="human"))
    announce("smgd listening on http://127.0.0.1:1", url="http://127.0.0.1:1")
    assert flush_logs()
    assert capsys.readouterr().err == "smgd listening on http://127.0.0.1:1\n"


@pytest.mark.parametrize("form", ["human", "json"])
def test_announce_is_written_whatever_the_level(
    restore_logging: None, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    """The banner is what scripts wait for: at `level = "error"` the JSON one was dropped."""
    setup_logging(LoggingConfig(format=form, level="error"))  # type: ignore[arg-type]
    logging.getLogger("smgd").info("below the level")
    announce("smgd listening on http://127.0.0.1:1", url="http://127.0.0.1:1")
    assert flush_logs()
    err = capsys.readouterr().err
    assert "smgd listening on http://127.0.0.1:1" in err
    assert "below the level" not in err


def test_license_file_matches_pyproject() -> None:
    root = Path(__file__).resolve().parent.parent
    meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0"
    text = (root / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
