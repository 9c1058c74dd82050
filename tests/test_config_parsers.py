"""The per-engine `tool_parser` / `reasoning_parser` keys: vLLM's names, checked at load."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from smgd.config import load_config
from smgd.errors import ConfigError
from smgd.parse import REASONING_PARSERS, TOOL_PARSERS

if TYPE_CHECKING:
    from pathlib import Path

ENGINE = '[[engines]]\nname = "e{i}"\nwire = "mock"\nmodels = ["m{i}"]\nmodel_dir = "m"\n'


def write(tmp_path: Path, *extras: str) -> Path:
    (tmp_path / "m").mkdir(exist_ok=True)
    path = tmp_path / "smgd.toml"
    path.write_text("".join(ENGINE.format(i=i) + extra for i, extra in enumerate(extras)))
    return path


@pytest.mark.parametrize("tool", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
def test_every_registered_name_loads(tmp_path: Path, tool: str, reasoning: str) -> None:
    path = write(tmp_path, f'tool_parser = "{tool}"\nreasoning_parser = "{reasoning}"\n')
    engine = load_config(path, environ={}).engines[0]
    assert (engine.tool_parser, engine.reasoning_parser) == (tool, reasoning)


def test_default_is_no_parser(tmp_path: Path) -> None:
    engine = load_config(write(tmp_path, ""), environ={}).engines[0]
    assert engine.tool_parser is None and engine.reasoning_parser is None


@pytest.mark.parametrize(
    ("key", "value", "message", "hint"),
    [
        (
            "tool_parser",
            "hermes2",
            "unknown tool parser 'hermes2'",
            "did you mean `hermes`? valid: deepseek_v3, hermes, llama3_json, mistral, "
            "pythonic, qwen3_coder",
        ),
        (
            "reasoning_parser",
            "o1",
            "unknown reasoning parser 'o1'",
            "valid: deepseek_r1, qwen3",
        ),
    ],
)
def test_unknown_name_is_an_error_at_its_key(
    tmp_path: Path, key: str, value: str, message: str, hint: str
) -> None:
    # The second engine: the path names which one.
    path = write(tmp_path, "", f'{key} = "{value}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert info.value.path == f"$.engines[1].{key}"
    assert info.value.message == message
    assert info.value.hint == hint


def test_override_from_the_environment_is_checked(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    env = {"SMGD_ENGINES__0__TOOL_PARSER": "llama3_json"}
    assert load_config(path, environ=env).engines[0].tool_parser == "llama3_json"
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"SMGD_ENGINES__0__REASONING_PARSER": "qwen"})
    assert info.value.path == "$.engines[0].reasoning_parser"
