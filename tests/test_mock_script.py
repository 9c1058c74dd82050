"""Mock engine scripts: the file format, its config key, and the mock's loading of it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from smgd.assets import TINY_MODEL_DIR
from smgd.config import load_config, load_mock_script
from smgd.errors import ConfigError
from smgd.launch import mock_script_args
from smgd.mock.engine import FAULTS
from smgd.mock.main import add_mock_args, load_script
from smgd.text.tokenizer import load_tokenizer

ENGINE = (
    '[[engines]]\nname = "e"\nwire = "mock"\nmodels = ["m"]\n'
    f'model_dir = "{TINY_MODEL_DIR}"\n[engines.mock]\n'
)
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = f"""
[[reply]]
when = "weather"
text = '''{TOOL_CALL}'''

[[reply]]
text = "fallback"
"""


def test_script_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "replies.toml"
    path.write_text(SCRIPT)
    script = load_mock_script(path)
    assert [(r.when, r.text) for r in script.reply] == [("weather", TOOL_CALL), ("", "fallback")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[reply]]\nwen = 'x'\ntext = 'y'\n", "unknown key `wen` at reply[0].wen"),
        ("[[reply]]\nwhen = 'x'\n", "missing required key `text` at reply[0].text"),
        ("[[reply]]\ntext = 3\n", "Expected `str`, got `int` at reply[0].text"),
        ("reply = 'x'\n", "Expected `array`, got `str` at reply"),
        ("[[reply]\n", "is not valid TOML"),
    ],
)
def test_bad_script_is_a_config_error_at_the_key(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "replies.toml").write_text(text)
    config = tmp_path / "smgd.toml"
    config.write_text(ENGINE + 'script = "replies.toml"\n')
    with pytest.raises(ConfigError) as info:
        load_config(config, environ={})
    assert info.value.path == "$.engines[0].mock.script"
    assert message in info.value.message
    assert str(tmp_path / "replies.toml") in info.value.message


def test_missing_script_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "smgd.toml"
    config.write_text(ENGINE + 'script = "nowhere.toml"\n')
    with pytest.raises(ConfigError, match="cannot read mock script") as info:
        load_config(config, environ={})
    assert info.value.path == "$.engines[0].mock.script"


def test_script_resolves_against_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "replies.toml").write_text(SCRIPT)
    config_path = tmp_path / "smgd.toml"
    config_path.write_text(ENGINE + 'script = "replies.toml"\n')
    config = load_config(config_path, environ={})
    args = mock_script_args(config.engines[0], config)
    assert args == ["--script", str(tmp_path / "replies.toml"), "--model-dir", str(TINY_MODEL_DIR)]
    config.engines[0].mock.script = None
    assert mock_script_args(config.engines[0], config) == []  # the plain echo: no tokenizer


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_mock_args(parser)
    return parser.parse_args(["--input", "ipc://i", "--output", "ipc://o", *argv])


def test_mock_writes_replies_with_the_models_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "replies.toml"
    path.write_text(SCRIPT)
    script = load_script(_args("--script", str(path), "--model-dir", str(TINY_MODEL_DIR)))
    assert script is not None
    tok = load_tokenizer(TINY_MODEL_DIR)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "weather in Paris?"}]))
    reply = script.pick(prompt)
    assert reply is not None and tok.decode(reply) == TOOL_CALL
    assert len(reply) > 1  # written token by token, not as one piece
    assert tok.decode(script.pick(tok.encode("hello")) or []) == "fallback"
    assert load_script(_args()) is None


def test_mock_refuses_a_script_it_cannot_use(tmp_path: Path) -> None:
    path = tmp_path / "replies.toml"
    path.write_text("[[reply]]\n")
    with pytest.raises(SystemExit, match="needs --model-dir"):
        load_script(_args("--script", str(path)))
    with pytest.raises(SystemExit, match="missing required key `text`"):
        load_script(_args("--script", str(path), "--model-dir", str(TINY_MODEL_DIR)))


def test_the_documented_example_does_what_the_reference_says(tmp_path: Path) -> None:
    doc = (Path(__file__).parent.parent / "docs/reference/config.md").read_text()
    example = doc.split("```toml\n# replies.toml")[1].split("```")[0]
    path = tmp_path / "replies.toml"
    path.write_text("# replies.toml" + example)
    script = load_script(_args("--script", str(path), "--model-dir", str(TINY_MODEL_DIR)))
    assert script is not None
    tok = load_tokenizer(TINY_MODEL_DIR)
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = {"id": "call_1", "type": "function", "function": function}
    asked: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    answered = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    replies = []
    for turns in (asked, answered):
        prompt = tok.encode(tok.render_chat(turns), add_special_tokens=False)
        replies.append(tok.decode(script.pick(prompt) or []))
    hello = tok.encode(tok.render_chat([{"role": "user", "content": "Hi"}]))
    replies.append(tok.decode(script.pick(hello) or []))
    assert replies[0].startswith("<tool_call>\n")
    assert replies[1:] == [
        "It is 21 °C in Paris.",
        "<think>\nNothing to look up.\n</think>\n\nHello!",
    ]


def test_every_fault_but_ok_can_be_injected_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_mock_args(parser)
    base = ["--input", "ipc:///x", "--output", "ipc:///y"]
    for fault in FAULTS:
        if fault == "ok":
            continue
        assert parser.parse_args([*base, "--fault", fault]).fault == fault
