"""Config schema: strict keys with paths, overrides by env and CLI, cross-field checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from smgd.cli import main
from smgd.config import RoutingPolicy, WireFamily, diff_engines, load_config
from smgd.errors import ConfigError

ENGINE = 'name = "{name}"\nwire = "{wire}"\nmodels = ["{model}"]\nmodel_dir = "m"\n'


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "m").mkdir(exist_ok=True)
    path = tmp_path / "smgd.toml"
    path.write_text(text)
    return path


def engine(name: str = "a", wire: str = "mock", model: str = "x") -> str:
    return "[[engines]]\n" + ENGINE.format(name=name, wire=wire, model=model)


def error_of(path: Path, **kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={}, **kwargs)  # type: ignore[arg-type]
    return info.value


def test_defaults_and_engine_parse(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, engine()), environ={})
    assert config.server.port == 8080
    assert config.engines[0].wire is WireFamily.MOCK
    assert config.engines[0].mock.step_ms == 20.0
    assert config.routing.policy is RoutingPolicy.LEAST_OUTSTANDING
    assert config.base_dir == str(tmp_path.resolve())


def test_unknown_key_names_the_path_and_suggests(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "[server]\nprot = 1\n"))
    assert err.path == "$.server.prot"
    assert err.hint is not None and "port" in err.hint


def test_unknown_key_in_nested_engine_table(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine() + "[engines.timeouts]\nsilense_s = 1\n"))
    assert err.path == "$.engines[0].timeouts.silense_s"
    assert err.hint is not None and "silence_s" in err.hint


def test_wrong_type(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, '[server]\nport = "80"\n'))
    assert err.path == "$.server.port"
    assert "Expected `int`" in err.message


def test_duplicate_engine_name(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine("a", model="x") + engine("a", model="y")))
    assert err.path == "$.engines[1].name"
    assert "duplicate" in err.message


def test_missing_model_dir(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine().replace('"m"', '"nope"')))
    assert err.path == "$.engines[0].model_dir"


def test_bad_wire_family(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine() + engine("b", wire="tgi")))
    assert err.path == "$.engines[1].wire"
    assert err.hint is not None and "sglang" in err.hint


def test_missing_required_key(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, '[[engines]]\nname = "a"\nwire = "mock"\nmodels = ["x"]\n'))
    assert err.path == "$.engines[0].model_dir"


def test_env_then_cli_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 1000\n" + engine())
    env = {"SMGD_SERVER__PORT": "2000", "SMGD_ENGINES__0__MOCK__STEP_MS": "5"}
    assert load_config(path, environ=env).server.port == 2000
    assert load_config(path, environ=env).engines[0].mock.step_ms == 5.0
    config = load_config(path, environ=env, overrides=["server.port=3000"])
    assert config.server.port == 3000


def test_top_level_run_dir_from_env(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, engine()), environ={"SMGD_RUN_DIR": "/run/x"})
    assert config.run_dir == "/run/x"


def test_override_past_list_end_is_an_error(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine()), overrides=["engines.3.name=z"])
    assert "past the end" in err.message


def test_routing_for_unserved_model(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine() + '[routing.models]\nnope = "round_robin"\n'))
    assert err.path == "$.routing.models.nope"


def test_diff_engines(tmp_path: Path) -> None:
    old = load_config(write(tmp_path, engine("a") + engine("b", model="y")), environ={})
    new_text = engine("a") + engine("b", model="z") + engine("c", model="w")
    new = load_config(write(tmp_path, new_text), environ={})
    added, removed, changed = diff_engines(old, new)
    assert [e.name for e in added] == ["c"]
    assert removed == []
    assert [e.name for e in changed] == ["b"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[server]\nprot = 1\n", "$.server.prot"),
        ('[server]\nport = "x"\n', "$.server.port"),
        (engine("a") + engine("a", model="y"), "$.engines[1].name"),
        (engine().replace('"m"', '"gone"'), "$.engines[0].model_dir"),
        (engine() + engine("b", wire="tgi"), "$.engines[1].wire"),
    ],
)
def test_check_config_cli_exit_2_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    path = write(tmp_path, text)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert needle in err
    assert "Traceback" not in err


def test_check_config_prints_resolved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, engine())
    assert main(["check-config", str(path), "--server-port", "1234"]) == 0
    assert '"port": 1234' in capsys.readouterr().out


def test_repo_default_config_is_valid() -> None:
    root = Path(__file__).resolve().parent.parent
    config = load_config(root / "smgd.toml", environ={})
    assert config.engines[0].wire is WireFamily.MOCK
