"""LoRA adapters: the [engines.lora] schema, launch flags, the adapter table, routing by
adapter name, and the smgd_lora_requests_info gauge (no daemon; test_lora_daemon.py runs one).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest

from smgd.api.handlers.lora import load_lora_adapter
from smgd.config import Config, EngineConfig, LoraConfig, RoutingConfig, WireFamily, load_config
from smgd.engines.base import EngineClient
from smgd.engines.lora import LoraTable, lora_args, static_adapters
from smgd.engines.lora_metrics import LoraInfoCollector
from smgd.errors import ConfigError, EngineRejected, InvalidRequest, ModelNotFound
from smgd.reload import replace_keys
from smgd.router import Router
from smgd.wire.common import EngineInfo, GenerateRequest, LoraAdapter, SamplingParams

if TYPE_CHECKING:
    from collections.abc import Mapping

    from smgd.api.core.prepare import Call


def adapter_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    return path


def engine_toml(
    name: str, model: str, lora: str = "", *, wire: str = "vllm", launch: str = ""
) -> str:
    text = f'[[engines]]\nname = "{name}"\nwire = "{wire}"\nmodels = ["{model}"]\nmodel_dir = "m"\n'
    if launch:
        text += f"[engines.launch]\n{launch}\n"
    if lora:
        text += f"[engines.lora]\n{lora}\n"
    return text


def load(tmp_path: Path, *engines: str) -> object:
    (tmp_path / "m").mkdir(exist_ok=True)
    path = tmp_path / "smgd.toml"
    path.write_text("".join(engines))
    return load_config(path, environ={})


def error_of(tmp_path: Path, *engines: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, *engines)
    return info.value


# ---------------------------------------------------------------------------- config


def test_adapters_parse_with_paths_resolved_against_the_config(tmp_path: Path) -> None:
    adapter_dir(tmp_path, "sql")
    config = load(tmp_path, engine_toml("a", "m1", 'adapters = {sql = "sql"}\nmax_loras = 2'))
    engine = config.engines[0]  # type: ignore[attr-defined]
    assert engine.lora.max_loras == 2
    assert not engine.lora.allow_runtime_updates
    assert static_adapters(config, engine) == [  # type: ignore[arg-type]
        LoraAdapter(name="sql", path=str(tmp_path / "sql"), int_id=1)
    ]


@pytest.mark.parametrize(
    ("lora", "path", "words"),
    [
        ('adapters = {"a:b" = "sql"}', "$.engines[0].lora.adapters.a:b", "no ':'"),
        ('adapters = {"a,b" = "sql"}', "$.engines[0].lora.adapters.a,b", "no ':' or ','"),
        ('adapters = {m1 = "sql"}', "$.engines[0].lora.adapters.m1", "is a model name"),
        ('adapters = {sql = "nowhere"}', "$.engines[0].lora.adapters.sql", "no adapter_config"),
        ("max_loras = 0", "$.engines[0].lora.max_loras", ">= 1"),
        ("max_lora_rank = 1024", "$.engines[0].lora.max_lora_rank", "<= 512"),
        ("allow = true", "$.engines[0].lora.allow", "unknown"),
    ],
)
def test_bad_lora_settings_name_their_key(tmp_path: Path, lora: str, path: str, words: str) -> None:
    adapter_dir(tmp_path, "sql")
    err = error_of(tmp_path, engine_toml("a", "m1", lora))
    assert err.path == path
    assert words in err.message


def test_an_adapter_on_engines_of_different_models_is_refused(tmp_path: Path) -> None:
    adapter_dir(tmp_path, "sql")
    lora = 'adapters = {sql = "sql"}'
    err = error_of(tmp_path, engine_toml("a", "m1", lora), engine_toml("b", "m2", lora))
    assert err.path == "$.engines[1].lora.adapters.sql"
    assert "engines[0]" in err.message
    # The same adapter on two engines of one model is a replica set: fine.
    load(tmp_path, engine_toml("a", "m1", lora), engine_toml("b", "m1", lora))


def test_an_adapter_named_like_another_engines_model_is_refused(tmp_path: Path) -> None:
    adapter_dir(tmp_path, "m2")
    err = error_of(
        tmp_path, engine_toml("a", "m1", 'adapters = {m2 = "m2"}'), engine_toml("b", "m2")
    )
    assert err.path == "$.engines[0].lora.adapters.m2"


def test_tokenspeed_takes_no_adapters(tmp_path: Path) -> None:
    err = error_of(tmp_path, engine_toml("a", "m1", "max_loras = 2", wire="tokenspeed"))
    assert err.path == "$.engines[0].lora"


def test_lora_flags_are_set_in_one_place(tmp_path: Path) -> None:
    launch = 'kind = "vllm"\nargs = ["--max-loras=8"]'
    err = error_of(tmp_path, engine_toml("a", "m1", "max_loras = 2", launch=launch))
    assert err.path == "$.engines[0].launch.args"
    # Without [engines.lora] the flags pass through to the engine untouched.
    load(tmp_path, engine_toml("a", "m1", launch=launch))


def test_launch_flags(tmp_path: Path) -> None:
    adapter_dir(tmp_path, "sql")
    lora = 'adapters = {sql = "sql"}\nmax_loras = 2\nmax_lora_rank = 8'
    config = load(
        tmp_path,
        engine_toml("v", "m1", lora, launch='kind = "vllm"'),
        engine_toml("s", "m1", lora, wire="sglang", launch='kind = "sglang"'),
        engine_toml("n", "m2", launch='kind = "vllm"'),
    )
    vllm, sglang, plain = config.engines  # type: ignore[attr-defined]
    assert lora_args(config, vllm) == [  # type: ignore[arg-type]
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
    ]  # fmt: skip
    assert lora_args(config, sglang) == [  # type: ignore[arg-type]
        "--enable-lora", "--max-loras-per-batch", "2", "--max-lora-rank", "8",
        "--lora-paths", f"sql={tmp_path / 'sql'}",
    ]  # fmt: skip
    assert lora_args(config, plain) == []  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- table


def test_a_reloaded_name_keeps_its_id_and_a_new_one_gets_the_next() -> None:
    table = LoraTable(None, [LoraAdapter(name="a", path="/a", int_id=1)])
    again = table.new("a", "/a2")
    assert (again.int_id, again.path) == (1, "/a2")
    fresh = table.new("b", "/b")
    table.add(fresh)
    assert fresh.int_id == 2
    assert table.remove("b") == fresh
    assert "b" not in table
    assert table.new("c", "/c").int_id == 3  # ids are never reused: the engine may cache one


def test_requests_count_waiting_then_running_then_nothing() -> None:
    table = LoraTable(None, [])
    table.begin("a")
    assert (dict(table.waiting), dict(table.running)) == ({"a": 1}, {})
    table.sent("a")
    assert (dict(table.waiting), dict(table.running)) == ({}, {"a": 1})
    table.end("a", sent=True)
    assert (dict(table.waiting), dict(table.running)) == ({}, {})
    table.begin("a")
    table.end("a", sent=False)  # never sent (admission refused it): its waiting count goes too
    assert not table.waiting
    table.begin(None)
    table.sent(None)
    assert not table.running
    table.end(None, sent=True)
    assert (dict(table.waiting), dict(table.running)) == ({}, {})


def test_an_engines_own_queues_decide_running_and_waiting_for_what_smgd_has_in_flight() -> None:
    table = LoraTable(None, [])
    for name in "abc":
        table.begin(name)
        table.sent(name)
    table.begin("q")  # still in smgd's admission queue
    assert table.busy() == ({"a", "b", "c"}, {"q"})  # no report yet: sent = running
    table.report(0, ["a", "stale"], ["b"])  # c was sent after this report
    assert table.busy() == ({"a", "c"}, {"b", "q"})
    table.report(1, ["b"], [])  # another rank runs b
    assert table.busy() == ({"a", "b", "c"}, {"b", "q"})
    table.end("q", sent=False)
    for name in "abc":
        table.end(name, sent=True)
    assert table.busy() == (set(), set())  # a report never outlives the requests


# ---------------------------------------------------------------------------- routing


class _Engine:
    """What the router and the collector read of an engine client."""

    def __init__(self, name: str, models: tuple[str, ...], adapters: list[str]) -> None:
        self.name = name
        self.models = models
        self.ready = True
        self.in_flight = 0
        self.load = None
        self.state_name = "ready"
        config = LoraConfig()  # defaults: max_loras 4
        self.lora = LoraTable(
            config,
            [LoraAdapter(name=a, path=f"/{a}", int_id=i + 1) for i, a in enumerate(adapters)],
        )


def names(engines: list[EngineClient]) -> list[str]:
    return sorted(e.name for e in engines)


def clients(*engines: _Engine) -> list[EngineClient]:
    return cast("list[EngineClient]", list(engines))


def _router(*engines: _Engine) -> Router:
    router = Router(RoutingConfig())
    for engine in engines:
        router.put(engine)  # type: ignore[arg-type]
    return router


def test_an_adapter_is_addressed_by_its_name_or_as_base_colon_adapter() -> None:
    a = _Engine("a", ("base",), ["sql"])
    b = _Engine("b", ("base",), [])
    c = _Engine("c", ("other",), ["chat"])
    router = _router(a, b, c)
    assert router.adapter_of("base") is None
    assert router.adapter_of("sql") == ("base", "sql")
    assert router.adapter_of("base:sql") == ("base", "sql")
    assert router.adapter_of("other:chat") == ("other", "chat")
    assert router.adapter_of("other:sql") is None  # not an adapter of that model
    assert names(router.candidates("sql")) == ["a"]  # only engines that hold it
    assert names(router.candidates("base:sql")) == ["a"]
    assert names(router.candidates("base")) == ["a", "b"]
    for unknown in ("nope", "base:nope", "other:sql"):
        with pytest.raises(ModelNotFound):
            router.candidates(unknown)


def test_validate_refuses_an_adapter_the_engine_no_longer_holds() -> None:
    config = EngineConfig(name="e", wire=WireFamily.MOCK, models=["m"], model_dir="/m")
    client = EngineClient(
        config, fallback_info=None, adapters=[LoraAdapter(name="a", path="/a", int_id=1)]
    )
    client.info = EngineInfo(max_model_len=64, vocab_size=100)
    req = GenerateRequest(rid="r", prompt_ids=[7], sampling=SamplingParams(max_tokens=1), lora="a")
    client.validate(req)
    client.lora.remove("a")
    with pytest.raises(ModelNotFound):
        client.validate(req)


# ---------------------------------------------------------------------------- metric


def test_lora_requests_info_has_vllms_name_labels_and_timestamp_value() -> None:
    a = _Engine("a", ("base",), ["sql", "chat"])
    b = _Engine("b", ("base",), ["sql"])
    plain = _Engine("p", ("x",), [])
    plain.lora.enabled = False
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LoraInfoCollector(lambda: clients(a, b, plain), clock=lambda: 1764680000.5))
    a.lora.begin("sql")
    a.lora.sent("sql")
    b.lora.begin("chat")
    text = generate_latest(registry).decode()
    assert "# TYPE smgd_lora_requests_info gauge" in text
    line = (
        'smgd_lora_requests_info{max_lora="8",running_lora_adapters="sql",'
        'waiting_lora_adapters="chat"} 1.7646800005e+09'
    )
    assert line in text
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LoraInfoCollector(lambda: clients(plain)))
    assert "lora" not in generate_latest(registry).decode()  # no engine with LoRA: no series


def test_a_changed_lora_table_replaces_the_engine_on_reload() -> None:
    old = EngineConfig(name="e", wire=WireFamily.VLLM, models=["m"], model_dir="/m")
    new = msgspec.structs.replace(old, lora=LoraConfig(adapters={"sql": "/sql"}))
    assert replace_keys(old, new) == ["lora"]
    more = msgspec.structs.replace(new, lora=LoraConfig(adapters={"sql": "/sql"}, max_loras=8))
    assert replace_keys(new, more) == ["lora"]


def test_with_workers_every_worker_holds_each_adapter(tmp_path: Path) -> None:
    adapter_dir(tmp_path, "sql")
    lora = 'adapters = {sql = "sql"}'
    workers = "[server]\nworkers = 2\n"
    err = error_of(tmp_path, workers, engine_toml("a", "m1", lora), engine_toml("b", "m1"))
    assert err.path == "$.engines[0].lora.adapters.sql"
    assert "worker 1" in err.message
    load(tmp_path, workers, engine_toml("a", "m1", lora), engine_toml("b", "m1", lora))


# ---------------------------------------------------------------------------- run-time loads


class _Loader(_Engine):
    """An engine whose loads wait for ``release`` and fail when ``refuse`` is set."""

    def __init__(self, name: str, *, refuse: bool = False) -> None:
        super().__init__(name, ("base",), [])
        self.lora.runtime_updates = True
        self.release = trio.Event()
        self.refuse = refuse

    async def load_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        await self.release.wait()
        if self.refuse:
            raise EngineRejected(f"engine {self.name} refused it", param="lora_path")
        self.lora.add(self.lora.new(name, path))


def _call(engines: list[_Loader], body: Mapping[str, object]) -> Call:
    gateway = SimpleNamespace(config=Config(), router=_router(*engines))
    ctx = SimpleNamespace(gateway=gateway)

    async def json() -> Mapping[str, object]:
        return body

    return cast("Call", SimpleNamespace(ctx=ctx, json=json))


async def test_a_second_load_of_a_name_under_way_is_refused() -> None:
    engine = _Loader("a")
    body = {"lora_name": "x", "lora_path": "/x"}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load_lora_adapter, _call([engine], body))
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(5), pytest.raises(InvalidRequest, match="being loaded"):
            await load_lora_adapter(_call([engine], body))  # at once, not after the first
        engine.release.set()
    assert "x" in engine.lora
    assert not engine.lora.loading


async def test_an_adapter_one_engine_refuses_is_served_by_none() -> None:
    took, refused = _Loader("a"), _Loader("b", refuse=True)
    took.release.set()
    refused.release.set()
    with pytest.raises(EngineRejected):
        await load_lora_adapter(_call([took, refused], {"lora_name": "x", "lora_path": "/x"}))
    assert "x" not in took.lora  # loaded there first, then forgotten again
    assert not took.lora.loading and not refused.lora.loading
