"""Config schema: strict keys with paths, overrides by env and CLI, cross-field checks."""

from __future__ import annotations

import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from smgd.api.http.app import create_admin_app
from smgd.api.http.dispatch import authorized
from smgd.assets import DEFAULT_CONFIG, TINY_MODEL_DIR
from smgd.cli import main
from smgd.config import (
    AdminConfig,
    Config,
    RoutingPolicy,
    ServerConfig,
    WireFamily,
    default_run_dir,
    diff_engines,
    load_admin_token,
    load_api_keys,
    load_config,
    resolve_path,
    run_dir,
)
from smgd.errors import ConfigError
from smgd.gateway import Gateway
from smgd.reload import ReloadResult
from tests.asgi_client import lifespan, request
from tests.fake_engine import MODEL, FakeEngine, get, open_app, open_gateway, post

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
    assert err.path == "$.engines"


@pytest.mark.parametrize(
    ("args", "env", "at", "origin"),
    [
        (["--set", "server.port.x=1"], {}, "$.server.port", "--set server.port.x"),
        (["--set", "engines.0.name.x=1"], {}, "$.engines[0].name", "--set engines.0.name.x"),
        (
            ["--set", "engines.0.models.0.x=1"],
            {},
            "$.engines[0].models[0]",
            "--set engines.0.models.0.x",
        ),
        ([], {"SMGD_SERVER__PORT__X": "1"}, "$.server.port", "SMGD_SERVER__PORT__X"),
    ],
)
def test_an_override_below_a_value_names_the_value_and_the_override(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    at: str,
    origin: str,
) -> None:
    # server.port is a number in the file: `server.port.x` has nowhere to go (it was a
    # TypeError traceback).
    text = "[server]\nport = 8080\n" + engine().replace('"m"', '"builtin:tiny-model"')
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["check-config", str(write(tmp_path, text)), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"smgd: config error at {at}: {origin}: {at} is a value ("), err
    assert len(err.splitlines()) == 1


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
    path = write(tmp_path, engine().replace('"m"', '"builtin:tiny-model"'))
    assert main(["check-config", str(path), "--server-port", "1234"]) == 0
    assert '"port": 1234' in capsys.readouterr().out


def test_repo_default_config_is_valid() -> None:
    root = Path(__file__).resolve().parent.parent
    config = load_config(root / "smgd.toml", environ={})
    assert config.engines[0].wire is WireFamily.MOCK


# --------------------------------------------------------------------------- ranges


def _numbers(node: msgspec.inspect.Type, path: str) -> Iterator[tuple[str, msgspec.inspect.Type]]:
    """Every int/float type reachable in the schema, with its key path."""
    if isinstance(node, msgspec.inspect.UnionType):
        for inner in node.types:
            yield from _numbers(inner, path)
    elif isinstance(node, msgspec.inspect.StructType):
        for field in node.fields:
            yield from _numbers(field.type, f"{path}.{field.name}")
    elif isinstance(node, msgspec.inspect.ListType):
        yield from _numbers(node.item_type, f"{path}[0]")
    elif isinstance(node, msgspec.inspect.DictType):
        yield from _numbers(node.value_type, f"{path}.KEY")
    elif isinstance(node, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        yield path, node


NUMBERS = list(_numbers(msgspec.inspect.type_info(Config), "$"))


def test_the_schema_has_numbers() -> None:
    assert len(NUMBERS) > 15  # the walk finds them (the next test is not vacuous)


@pytest.mark.parametrize(("path", "node"), NUMBERS, ids=[p for p, _ in NUMBERS])
def test_every_number_in_the_schema_has_a_range(path: str, node: Any) -> None:
    # A new numeric key without Annotated[..., msgspec.Meta(ge=.., le=..)] fails here: a
    # negative size or a NaN/infinite timeout would otherwise load and misbehave at run time.
    assert node.ge is not None or node.gt is not None, f"{path} has no lower bound"
    assert node.le is not None or node.lt is not None, f"{path} has no upper bound (not finite)"


IMPOSSIBLE = [
    ("server.max_body_bytes", "-5"),
    ("server.max_body_bytes", "0"),
    ("server.drain_timeout_s", "nan"),
    ("server.drain_timeout_s", "-1"),
    ("server.drain_settle_s", "-inf"),
    ("server.keepalive_interval_s", "inf"),
    ("server.coalesce_max_ms", "nan"),
    ("server.port", "70000"),
    ("server.workers", "0"),
    ("server.workers", "65"),
    ("admin.port", "-1"),
    ("routing.prefix_tokens", "0"),
    ("engines.0.mock.step_ms", "-3"),
    ("engines.0.mock.max_batch", "0"),
    ("engines.0.mock.max_model_len", "0"),
    ("engines.0.max_queue", "-1"),
    ("engines.0.max_inflight", "-1"),
    ("engines.0.max_model_len", "0"),
    ("engines.0.queue_timeout_s", "nan"),
    ("engines.0.timeouts.ready_s", "0"),
    ("engines.0.timeouts.silence_s", "inf"),
    ("engines.0.timeouts.health_interval_s", "-1"),
]


def _msgspec_path(dotted: str) -> str:
    return "$" + re.sub(r"\.(\d+)", r"[\1]", "." + dotted)


@pytest.mark.parametrize(("key", "value"), IMPOSSIBLE)
def test_impossible_values_are_refused_with_their_key_path(
    tmp_path: Path, key: str, value: str
) -> None:
    err = error_of(write(tmp_path, engine()), overrides=[f"{key}={value}"])
    assert err.path == _msgspec_path(key)
    assert err.hint is not None and key.rsplit(".", 1)[-1] in err.hint
    assert "<=" in err.hint  # the hint gives the whole range


@pytest.mark.parametrize("value", ["nan", "inf", "-5.0"])
def test_impossible_values_in_the_file(tmp_path: Path, value: str) -> None:
    err = error_of(write(tmp_path, f"[server]\ndrain_timeout_s = {value}\n" + engine()))
    assert err.path == "$.server.drain_timeout_s"
    assert err.hint == "drain_timeout_s is a finite number >= 0 and <= 86400.0"


def test_zero_means_off_where_the_docs_say_so(tmp_path: Path) -> None:
    keys = [
        "server.keepalive_interval_s",
        "server.coalesce_max_ms",
        "server.drain_settle_s",
        "engines.0.max_inflight",
        "engines.0.timeouts.health_interval_s",
        "engines.0.mock.step_ms",
    ]
    load_config(write(tmp_path, engine()), environ={}, overrides=[f"{k}=0" for k in keys])


@pytest.mark.parametrize(
    ("key", "value", "wanted", "unwanted"),
    [
        ("logging.level", '"verbose"', "debug, error, info, warning", "round_robin"),
        ("logging.format", '"xml"', "human, json", "round_robin"),
        ("routing.policy", '"random"', "round_robin", "debug"),
        ("engines.0.wire", '"tgi"', "sglang", "round_robin"),
        ("engines.0.mock.wire", '"mock"', "tokenspeed", "round_robin"),
    ],
)
def test_choice_hint_lists_the_keys_own_choices(
    tmp_path: Path, key: str, value: str, wanted: str, unwanted: str
) -> None:
    err = error_of(write(tmp_path, engine()), overrides=[f"{key}={value}"])
    assert err.path == _msgspec_path(key)
    assert err.hint is not None and wanted in err.hint and unwanted not in err.hint


def test_routing_models_hint(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine() + '[routing.models]\nx = "fastest"\n'))
    assert err.path == "$.routing.models[...]"  # msgspec does not say which key
    assert err.hint == "one of round_robin, least_outstanding, prefix_affinity"


# --------------------------------------------------------------------------- socket paths


def _dir_of_length(tmp_path: Path, size: int) -> str:
    """A directory path of exactly ``size`` bytes under tmp_path (not created)."""
    base = str(tmp_path) + "/"
    assert size > len(base)
    return base + "d" * (size - len(base))


def test_run_dir_whose_sockets_do_not_fit_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, engine("a"))
    # <run_dir>/a/out.sock: 11 bytes after the directory; 107 is the limit.
    fits = _dir_of_length(tmp_path, 107 - len("/a/out.sock"))
    load_config(path, environ={}, overrides=[f'run_dir="{fits}"'])
    err = error_of(path, overrides=[f'run_dir="{fits}d"'])
    assert err.path == "$.run_dir"
    assert "108 bytes" in err.message and "107-byte" in err.message


def test_default_run_dir_from_a_long_xdg_runtime_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", _dir_of_length(tmp_path, 100))
    err = error_of(write(tmp_path, engine()))
    assert err.path == "$.run_dir"
    assert "(default run_dir)" in err.message


def test_ipc_dir_too_long_names_the_engine(tmp_path: Path) -> None:
    long = _dir_of_length(tmp_path, 100)
    err = error_of(write(tmp_path, engine() + engine("b", model="y") + f'ipc_dir = "{long}"\n'))
    assert err.path == "$.engines[1].ipc_dir"


def test_admin_socket_counts_only_when_it_is_a_socket(tmp_path: Path) -> None:
    # Engines with short ipc dirs, a run_dir only admin.sock would live in.
    text = engine() + 'ipc_dir = "/tmp/e"\n'
    run = _dir_of_length(tmp_path, 107 - len("/admin.sock") + 1)
    path = write(tmp_path, f'run_dir = "{run}"\n' + text)
    assert error_of(path).path == "$.run_dir"
    load_config(path, environ={}, overrides=["admin.port=9000"])  # TCP admin: no socket


def test_explicit_addresses_move_the_engine_sockets(tmp_path: Path) -> None:
    long = _dir_of_length(tmp_path, 100)
    tcp = 'input = "tcp://127.0.0.1:5001"\noutput = "tcp://127.0.0.1:5002"\n'
    text = f'run_dir = "{long}"\n[admin]\nport = 9000\n' + engine() + "[engines.addresses]\n"
    load_config(write(tmp_path, text + tcp), environ={})  # nothing is bound in run_dir
    err = error_of(
        write(tmp_path, text + tcp.replace("tcp://127.0.0.1:5002", f"ipc://{long}/out.sock"))
    )
    assert err.path == "$.engines[0].addresses.output"
    vllm = text.replace('wire = "mock"', 'wire = "vllm"') + tcp
    assert error_of(write(tmp_path, vllm)).path == "$.run_dir"  # hs.sock is still there


@pytest.mark.parametrize("address", ["foo://bar", "/run/smgd/in.sock", "inproc://x", ""])
def test_an_address_that_is_no_ipc_or_tcp_endpoint_is_refused(tmp_path: Path, address: str) -> None:
    text = engine() + f'[engines.addresses]\ninput = "{address}"\n'
    err = error_of(write(tmp_path, text))
    assert err.path == "$.engines[0].addresses.input"
    assert "not an ipc:// or tcp:// endpoint" in err.message


def test_two_engines_on_one_socket_are_refused(tmp_path: Path) -> None:
    shared = 'ipc_dir = "/tmp/smgd-shared"\n'
    err = error_of(write(tmp_path, engine() + shared + engine("b", model="y") + shared))
    assert err.path == "$.engines[1].ipc_dir"
    assert "'/tmp/smgd-shared' is $.engines[0]'s already" in err.message
    same = '[engines.addresses]\ninput = "tcp://127.0.0.1:5001"\n'
    err = error_of(write(tmp_path, engine() + same + engine("b", model="y") + same))
    assert err.path == "$.engines[1].addresses.input"
    # One engine's own endpoints, and "any free port" twice, are no conflict.
    free = '[engines.addresses]\nhandshake = "tcp://127.0.0.1:*"\n'
    load_config(write(tmp_path, engine() + free + engine("b", model="y") + free), environ={})


def test_an_engine_whose_socket_directory_is_the_admin_socket_is_refused(
    tmp_path: Path,
) -> None:
    err = error_of(write(tmp_path, engine("admin.sock")))
    assert err.path == "$.engines[0].name"
    assert "is the admin socket's path" in err.message
    load_config(write(tmp_path, engine("admin.sock")), environ={}, overrides=["admin.port=9000"])


def test_check_config_refuses_a_long_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f'run_dir = "{_dir_of_length(tmp_path, 120)}"\n' + engine())
    assert main(["check-config", str(path)]) == 2
    assert "config error at $.run_dir" in capsys.readouterr().err


# --------------------------------------------------------------------------- builtin paths


def test_builtin_model_dir_names_the_packaged_model(tmp_path: Path) -> None:
    text = engine().replace('"m"', '"builtin:tiny-model"')
    config = load_config(write(tmp_path, text), environ={})
    assert resolve_path(config, config.engines[0].model_dir) == TINY_MODEL_DIR


def test_unknown_builtin_is_refused_even_without_path_checks(tmp_path: Path) -> None:
    text = engine().replace('"m"', '"builtin:huge-model"')
    err = error_of(write(tmp_path, text), check_paths=False)
    assert err.path == "$.engines[0].model_dir"
    assert err.hint is not None and "builtin:tiny-model" in err.hint


@pytest.mark.parametrize(
    ("text", "at"),
    [
        (engine() + 'chat_template = "builtin:nope"\n', "$.engines[0].chat_template"),
        (engine() + 'tokenizer_dir = "builtin:nope"\n', "$.engines[0].tokenizer_dir"),
        (engine() + 'ipc_dir = "builtin:nope"\n', "$.engines[0].ipc_dir"),
        (engine() + '[engines.mock]\nscript = "builtin:nope"\n', "$.engines[0].mock.script"),
        (
            engine() + '[engines.lora]\nadapters = { sql = "builtin:nope" }\n',
            "$.engines[0].lora.adapters.sql",
        ),
        ('[server]\napi_keys_file = "builtin:nope"\n' + engine(), "$.server.api_keys_file"),
        ('run_dir = "builtin:nope"\n' + engine(), "$.run_dir"),
    ],
)
def test_an_unknown_builtin_is_refused_at_its_key(tmp_path: Path, text: str, at: str) -> None:
    err = error_of(write(tmp_path, text), check_paths=False)
    assert (err.path, err.message) == (at, "'builtin:nope' names no built-in directory")
    assert err.hint is not None and "builtin:tiny-model" in err.hint


@pytest.mark.parametrize(
    ("text", "at"),
    [
        (engine() + 'chat_template = "builtin:tiny-model"\n', "$.engines[0].chat_template"),
        (engine() + '[engines.mock]\nscript = "builtin:tiny-model"\n', "$.engines[0].mock.script"),
        ('[server]\napi_keys_file = "builtin:tiny-model"\n' + engine(), "$.server.api_keys_file"),
    ],
)
def test_a_builtin_directory_where_a_file_is_named_is_refused(
    tmp_path: Path, text: str, at: str
) -> None:
    err = error_of(write(tmp_path, text), check_paths=False)
    assert err.path == at
    assert err.message == "'builtin:tiny-model' is a packaged directory; this key names a file"


def test_missing_model_dir_hint_names_the_builtin(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine().replace('"m"', '"smgd/assets/tiny-model"')))
    assert err.hint is not None and "builtin:tiny-model" in err.hint


def test_repo_config_is_the_packaged_default() -> None:
    root = Path(__file__).resolve().parent.parent
    assert (root / "smgd.toml").read_text() == DEFAULT_CONFIG.read_text()


def test_default_config_loads_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(DEFAULT_CONFIG, environ={})
    assert config.engines[0].model_dir == "builtin:tiny-model"
    assert config.server.keepalive_interval_s == 0.0  # keep-alives off by default


def test_run_dir_is_a_top_level_key_in_the_default_config() -> None:
    # Uncommenting the documented `# run_dir = ...` line must give a valid config.
    text = DEFAULT_CONFIG.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("# run_dir ="))
    tree = tomllib.loads(text.replace(line, line[2:], 1))
    assert tree["run_dir"] == "/run/smgd"


# --------------------------------------------------------------------------- secrets


def _server(tmp_path: Path, **server: str) -> Config:
    return Config(server=ServerConfig(**server), base_dir=str(tmp_path))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, "", " ", " , ,"])
def test_api_keys_env_without_a_key_is_an_error(tmp_path: Path, value: str | None) -> None:
    env = {} if value is None else {"SMGD_API_KEYS": value}
    with pytest.raises(ConfigError) as info:
        load_api_keys(_server(tmp_path, api_keys_env="SMGD_API_KEYS"), env)
    assert info.value.path == "$.server.api_keys_env"
    assert info.value.message == "SMGD_API_KEYS is unset or empty"


@pytest.mark.parametrize("content", ["", "# only a comment\n", "\n  \n# a\n"])
def test_api_keys_file_without_a_key_is_an_error(tmp_path: Path, content: str) -> None:
    (tmp_path / "keys").write_text(content)
    with pytest.raises(ConfigError) as info:
        load_api_keys(_server(tmp_path, api_keys_file="keys"), {})
    assert info.value.path == "$.server.api_keys_file"
    assert "holds no key" in info.value.message


def test_api_keys_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_api_keys(_server(tmp_path, api_keys_file="missing"), {})
    assert info.value.path == "$.server.api_keys_file"


def test_api_keys_from_both_sources(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("# ops\nk3\n k1 \n")
    config = _server(tmp_path, api_keys_env="K", api_keys_file="keys")
    assert load_api_keys(config, {"K": "k1, k2"}) == (b"k1", b"k2", b"k3")
    assert load_api_keys(_server(tmp_path), {}) == ()  # nothing configured: no auth


@pytest.mark.parametrize("value", [None, "", "  "])
def test_admin_token_env_without_a_token_is_an_error(value: str | None) -> None:
    config = Config(admin=AdminConfig(port=9000, token_env="SMGD_ADMIN_TOKEN"))
    env = {} if value is None else {"SMGD_ADMIN_TOKEN": value}
    with pytest.raises(ConfigError) as info:
        load_admin_token(config, env)
    assert info.value.path == "$.admin.token_env"
    assert load_admin_token(config, {"SMGD_ADMIN_TOKEN": " t "}) == b"t"
    assert load_admin_token(Config(), {}) is None


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ["--server-api-keys-env", "SMGD_TEST_UNSET"],
            "$.server.api_keys_env: SMGD_TEST_UNSET is unset or empty",
        ),
        (["--server-api-keys-file", "empty-keys"], "$.server.api_keys_file: api_keys_file"),
        (
            ["--admin-token-env", "SMGD_TEST_UNSET", "--admin-port", "9000"],
            "$.admin.token_env: SMGD_TEST_UNSET is unset or empty",
        ),
    ],
)
def test_check_config_refuses_a_key_source_without_keys(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    needle: str,
) -> None:
    monkeypatch.delenv("SMGD_TEST_UNSET", raising=False)
    (tmp_path / "empty-keys").write_text("# nothing yet\n")
    assert main(["check-config", str(write(tmp_path, engine())), *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer k1", True),
        ("bearer k1", True),
        ("BEARER k2", True),
        ("  bearer   k2  ", True),
        ("Bearer k3", False),
        ("Basic k1", False),
        ("Bearerk1", False),
        ("Bearer", False),
        ("Bearer ", False),
        ("k1", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer_scheme_is_case_insensitive(header: str | None, ok: bool) -> None:
    assert authorized((b"k1", b"k2"), header) is ok


async def test_lowercase_bearer_on_the_api(autojump_clock: trio.abc.Clock) -> None:
    server = ServerConfig(api_keys_env="SMGD_TEST_KEYS")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    async with open_app(FakeEngine(), server=server, environ={"SMGD_TEST_KEYS": "k1"}) as (app, _):
        models = await get(app, "/v1/models", {"Authorization": "bearer k1"})
        completion = await post(app, "/v1/completions", body, {"Authorization": "BEARER k1"})
        wrong = await post(app, "/v1/completions", body, {"Authorization": "bearer k2"})
    assert (models.status, completion.status, wrong.status) == (200, 200, 401)


async def _unused_reload() -> ReloadResult:
    raise AssertionError("these tests do not reload")


def _unused_drain() -> None:
    raise AssertionError("these tests do not drain")


async def test_admin_token(autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMGD_TEST_ADMIN", "tok")
    async with open_gateway() as gateway:
        gateway.config = msgspec.structs.replace(
            gateway.config, admin=AdminConfig(port=9000, token_env="SMGD_TEST_ADMIN")
        )
        app = create_admin_app(gateway, _unused_reload, _unused_drain)
        async with lifespan(app):
            statuses = [
                (await request(app, "GET", "/admin/engines", b"", headers)).status
                for headers in (
                    {"Authorization": "bearer tok"},
                    {"Authorization": "Bearer tok"},
                    {"Authorization": "Bearer nope"},
                    {},
                )
            ]
    assert statuses == [200, 200, 401, 401]


async def test_admin_app_refuses_an_unset_token_env(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SMGD_TEST_UNSET", raising=False)
    async with open_gateway() as gateway:
        gateway.config = msgspec.structs.replace(
            gateway.config, admin=AdminConfig(port=9000, token_env="SMGD_TEST_UNSET")
        )
        with pytest.raises(ConfigError):  # never an admin listener without its token
            create_admin_app(gateway, _unused_reload, _unused_drain)


async def test_reload_that_would_open_auth_is_refused(autojump_clock: trio.abc.Clock) -> None:
    server = ServerConfig(api_keys_env="SMGD_TEST_KEYS")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    async with open_app(FakeEngine(), server=server, environ={"SMGD_TEST_KEYS": "k1"}) as (
        app,
        gateway,
    ):
        for broken in (
            ServerConfig(api_keys_env="SMGD_TEST_UNSET"),
            ServerConfig(api_keys_file="/nonexistent/keys"),
        ):
            new = msgspec.structs.replace(gateway.config, server=broken)
            with pytest.raises(ConfigError):
                gateway.prepare_reload(new)
        new = msgspec.structs.replace(
            gateway.config, admin=AdminConfig(token_env="SMGD_TEST_UNSET")
        )
        with pytest.raises(ConfigError):
            gateway.prepare_reload(new)
        missing = await post(app, "/v1/completions", body)
    assert missing.status == 401  # the old keys still guard the API


@pytest.mark.parametrize(
    ("host", "port", "token_env", "refused"),
    [
        ("0.0.0.0", 9000, None, True),  # every interface, no token: fail closed
        ("10.1.2.3", 9000, None, True),
        ("admin.example", 9000, None, True),  # a name may resolve anywhere
        ("0.0.0.0", 9000, "SMGD_ADMIN_TOKEN", False),
        ("127.0.0.1", 9000, None, False),  # loopback trusts the host's users
        ("::1", 9000, None, False),
        ("localhost", 9000, None, False),
        ("0.0.0.0", 0, None, False),  # port 0: the unix socket, host unused
    ],
)
def test_an_admin_port_other_hosts_reach_needs_a_token(
    tmp_path: Path, host: str, port: int, token_env: str | None, refused: bool
) -> None:
    token = f'token_env = "{token_env}"\n' if token_env else ""
    path = write(tmp_path, f'[admin]\nhost = "{host}"\nport = {port}\n{token}' + engine())
    if refused:
        error = error_of(path)
        assert error.path == "$.admin.token_env"
        assert f"{host}:{port}" in str(error)
    else:
        assert load_config(path, environ={}).admin.host == host


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    # TOML is UTF-8 whatever the locale: a Latin-1 comment saved by an editor is named as
    # such (a reload of it is refused the same way, not a crash of the daemon).
    path = tmp_path / "smgd.toml"
    path.write_bytes(b"[server]\nport = 8080\n# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert info.value.path == "$"
    assert info.value.message == f"{path} is not UTF-8 text (byte 26: 0xe9)"
    write(tmp_path, "[server]\nport = 8080\n# café\n" + engine())
    assert load_config(path, environ={}).server.port == 8080


# --------------------------------------------------------------------------- no engine


@pytest.mark.parametrize(
    "text", ["", "# smgd.toml\n", "[server]\nport = 8080\n", 'run_dir = "/tmp/r"\n']
)
def test_a_config_without_an_engine_is_refused(tmp_path: Path, text: str) -> None:
    # An empty or half-written file would start (or reload into) a gateway that answers
    # ready with no engine and 404s every request.
    err = error_of(write(tmp_path, text))
    assert err.path == "$.engines"
    assert err.hint is not None and "[[engines]]" in err.hint


# --------------------------------------------------------------------------- empty strings


@pytest.mark.parametrize(
    ("text", "at"),
    [
        ('[server]\nhost = ""\n' + engine(), "$.server.host"),
        ('[server]\nhost = " "\n' + engine(), "$.server.host"),
        ('[admin]\nhost = ""\nport = 9000\n' + engine(), "$.admin.host"),
        ('run_dir = ""\n' + engine(), "$.run_dir"),
        (engine().replace('"m"', '""'), "$.engines[0].model_dir"),
        (engine() + 'tokenizer_dir = ""\n', "$.engines[0].tokenizer_dir"),
        (engine() + 'ipc_dir = ""\n', "$.engines[0].ipc_dir"),
        (engine() + 'chat_template = ""\n', "$.engines[0].chat_template"),
        ('[server]\napi_keys_file = ""\n' + engine(), "$.server.api_keys_file"),
        (engine().replace('["x"]', '[""]'), "$.engines[0].models[0]"),
        (engine().replace('["x"]', '["x", "  "]'), "$.engines[0].models[1]"),
    ],
)
def test_an_empty_string_is_refused_at_its_key(tmp_path: Path, text: str, at: str) -> None:
    # Each used to mean something else silently: host "" every interface, run_dir "" the
    # default, a path "" the config file's directory, a model "" a name no one can ask for.
    assert error_of(write(tmp_path, text)).path == at


def test_run_dir_left_out_is_the_default(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, engine()), environ={})
    assert config.run_dir is None
    assert run_dir(config) == default_run_dir()


def test_a_model_name_listed_twice_in_one_engine_is_refused(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, engine().replace('["x"]', '["x", "y", "x"]')))
    assert err.path == "$.engines[0].models[2]"
    assert err.message == "model name 'x' is listed twice (also models[0])"


@pytest.mark.parametrize(
    ("server_host", "admin_host", "refused"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("0.0.0.0", "127.0.0.1", True),  # the wildcard takes the port on every address
        ("::", "127.0.0.1", True),  # and "::" on IPv4's too (dual-stack)
        ("::1", "::1", True),
        ("127.0.0.1", "127.0.0.2", False),
        ("127.0.0.1", "::1", False),
        ("0.0.0.0", "::1", False),
    ],
)
def test_the_admin_listener_cannot_take_the_public_port(
    tmp_path: Path, server_host: str, admin_host: str, refused: bool
) -> None:
    listeners = f'[server]\nhost = "{server_host}"\nport = 9000\n[admin]\nhost = "{admin_host}"\n'
    path = write(tmp_path, listeners + "port = 9000\n" + engine())
    if refused:
        err = error_of(path)
        assert err.path == "$.admin.port"
        assert err.message.startswith("admin.port 9000 is server.port too")
    else:
        assert load_config(path, environ={}).admin.port == 9000
    other = load_config(write(tmp_path, listeners + "port = 9001\n" + engine()), environ={})
    assert other.admin.port == 9001


def test_port_0_on_both_listeners_is_not_a_clash(tmp_path: Path) -> None:
    # server.port 0 is any free port; admin.port 0 the unix socket.
    config = load_config(write(tmp_path, "[server]\nport = 0\n" + engine()), environ={})
    assert (config.server.port, config.admin.port) == (0, 0)


# --------------------------------------------------------------------------- texts


TOKENIZER_JSON = (TINY_MODEL_DIR / "tokenizer.json").read_bytes()


def _model(tmp_path: Path, files: dict[str, bytes]) -> None:
    """The tiny model at tmp_path/model, then ``files`` written (relative to tmp_path)."""
    shutil.copytree(TINY_MODEL_DIR, tmp_path / "model")
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)


@pytest.mark.parametrize(
    ("files", "keys", "at", "needle"),
    [
        ({}, 'chat_template = "gone.jinja"\n', "chat_template", "cannot read chat template"),
        ({"bad.jinja": b"{% if %}"}, 'chat_template = "bad.jinja"\n', "chat_template", "compile"),
        ({"l1.jinja": b"caf\xe9"}, 'chat_template = "l1.jinja"\n', "chat_template", "not UTF-8"),
        ({"tok/x": b""}, 'tokenizer_dir = "tok"\n', "tokenizer_dir", "no tokenizer.json in"),
        ({"model/tokenizer.json": b"{}"}, "", "model_dir", "cannot load"),
        ({"model/tokenizer_config.json": b"garbage{"}, "", "model_dir", "is not valid JSON"),
        (
            {"model/tokenizer_config.json": b'{"chat_template": 5}'},
            "",
            "model_dir",
            "must be a string or a list",
        ),
        (
            {
                "tok/tokenizer.json": TOKENIZER_JSON,
                "tok/tokenizer_config.json": b'{"chat_template": 5}',
            },
            'tokenizer_dir = "tok"\n',
            "tokenizer_dir",
            "must be a string or a list",
        ),
        ({"model/config.json": b'{"x": "caf\xe9"}'}, "", "model_dir", "is not UTF-8 text"),
    ],
)
def test_check_config_loads_the_tokenizers_and_templates_serve_loads(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    files: dict[str, bytes],
    keys: str,
    at: str,
    needle: str,
) -> None:
    _model(tmp_path, files)
    text = engine().replace('"m"', '"model"') + keys
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:  # serve's own loading
        Gateway.from_config(load_config(path, environ={}))
    assert info.value.path == f"$.engines[0].{at}"
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"smgd: config error at $.engines[0].{at}: "), err
    assert needle in err and err == f"smgd: {info.value.one_line()}\n"


def test_check_config_needs_a_context_length_as_serve_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An engine smgd does not launch, on a model whose config.json has no context length.
    _model(tmp_path, {"model/config.json": b"{}"})
    text = engine(wire="sglang").replace('"m"', '"model"')
    assert main(["check-config", str(write(tmp_path, text))]) == 2
    assert "config error at $.engines[0].max_model_len: no context length" in (
        capsys.readouterr().err
    )
    assert main(["check-config", str(write(tmp_path, text + "max_model_len = 2048\n"))]) == 0


def test_an_unknown_top_level_key_lists_the_keys_one_may_write(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "bogus = 1\n" + engine()))
    assert err.path == "$.bogus"
    assert err.hint == "valid keys: server, admin, logging, routing, run_dir, engines"
