"""LoRA adapters through the whole daemon, on the mock engines of both wires.

The mock engines rotate a request's output by a fixed function of its adapter's name
(:func:`smgd.mock.scheduler.lora_rotation`), so each test knows exactly what the adapter's
output must be: the request reached the engine with that adapter, and no other.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from smgd.mock.scheduler import lora_rotation

from .daemon_harness import config_text, engine_toml, running_daemon
from .faults.harness import until

pytestmark = pytest.mark.slow

PROMPT = [100, 101, 102, 103, 104, 105]  # no special ids: the mock echoes every one
LORA_INFO = re.compile(
    r'smgd_lora_requests_info\{max_lora="4",running_lora_adapters="([^"]*)",'
    r'waiting_lora_adapters="([^"]*)"\}'
)


def adapter(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    return path


def rotated(name: str, ids: list[int]) -> list[int]:
    shift = lora_rotation(name, len(ids))
    return ids[shift:] + ids[:shift]


def write(tmp_path: Path, wire: str, *, runtime: bool = True, keys: str = "") -> Path:
    lora = keys + (
        f'[engines.lora]\nadapters = {{sql = "{adapter(tmp_path, "sql")}"}}\n'
        f"allow_runtime_updates = {'true' if runtime else 'false'}\n"
    )
    mock = engine_toml("e", "tiny", extra=lora).replace(
        "[engines.mock]\n", f'[engines.mock]\nwire = "{wire}"\n'
    )
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(mock))
    return path


async def output_ids(client: httpx.AsyncClient, model: str) -> Any:
    body = {"model": model, "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}}
    response = await client.post("/generate", json=body)
    if response.status_code != 200:
        return response.status_code, response.json()["error"]
    return response.json()["output_ids"]


@pytest.mark.parametrize("wire", ["vllm", "sglang"])
async def test_an_adapter_is_a_model_that_runs_on_its_base_models_engine(
    tmp_path: Path, wire: str
) -> None:
    async with running_daemon(write(tmp_path, wire)) as (_, client):
        assert await output_ids(client, "tiny") == PROMPT
        assert await output_ids(client, "sql") == rotated("sql", PROMPT) != PROMPT
        assert await output_ids(client, "tiny:sql") == rotated("sql", PROMPT)
        for unknown in ("nope", "tiny:nope", "sql:tiny"):
            status, error = await output_ids(client, unknown)
            assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
        # SGLang's own field: /generate's lora_path names the adapter of the model.
        native = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}}
        response = await client.post("/generate", json={**native, "lora_path": "sql"})
        assert response.json()["output_ids"] == rotated("sql", PROMPT)
        response = await client.post("/generate", json={**native, "lora_path": "nope"})
        assert (response.status_code, response.json()["error"]["param"]) == (404, "lora_path")
        response = await client.post("/generate", json={**native, "lora_path": ["sql"]})
        assert (response.status_code, response.json()["error"]["param"]) == (400, "lora_path")
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert chat.status_code == 200
        assert chat.json()["model"] == "sql"  # answered as the adapter, as vLLM does
        cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
        assert cards["sql"]["parent"] == "tiny"
        assert cards["sql"]["root"] == str(tmp_path / "sql")
        assert cards["sql"]["max_model_len"] == cards["tiny"]["max_model_len"]
        assert cards["tiny"]["parent"] is None
        assert (await client.get("/v1/models/sql")).json() == cards["sql"]
        metrics = (await client.get("/metrics")).text
        assert 'smgd_lora_requests_info{max_lora="4",running_lora_adapters=""' in metrics


async def test_adapters_load_and_unload_at_run_time(tmp_path: Path) -> None:
    chat = str(adapter(tmp_path, "chat"))
    async with running_daemon(write(tmp_path, "vllm")) as (_, client):
        assert (await output_ids(client, "chat"))[0] == 404
        load = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": chat}
        )
        assert load.status_code == 200
        assert load.text == "Success: LoRA adapter 'chat' added successfully."
        assert await output_ids(client, "chat") == rotated("chat", PROMPT)
        assert "chat" in {c["id"] for c in (await client.get("/v1/models")).json()["data"]}
        again = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": chat}
        )
        assert again.status_code == 400
        assert "already been loaded" in again.json()["error"]["message"]
        inplace = {"lora_name": "chat", "lora_path": chat, "load_inplace": True}
        assert (await client.post("/v1/load_lora_adapter", json=inplace)).status_code == 200
        unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert (unload.status_code, unload.text) == (
            200,
            "Success: LoRA adapter 'chat' removed successfully.",
        )
        assert (await output_ids(client, "chat"))[0] == 404
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert (gone.status_code, gone.json()["error"]["param"]) == (404, "lora_name")
        assert await output_ids(client, "sql") == rotated("sql", PROMPT)  # untouched


# (body, status, param, words in the message): vLLM's checks and answers, plus smgd's own.
BAD_LOADS: list[tuple[dict[str, Any], int, str, str]] = [
    ({"lora_name": "x"}, 400, "lora_path", "Both 'lora_name' and 'lora_path'"),
    ({"lora_path": "/x"}, 400, "lora_name", "Both 'lora_name' and 'lora_path'"),
    ({"lora_name": "tiny", "lora_path": "/x"}, 400, "lora_name", "conflicts with a served"),
    ({"lora_name": "a:b", "lora_path": "/x"}, 400, "lora_name", "no ':'"),
    ({"lora_name": 7, "lora_path": "/x"}, 400, "lora_name", "must be a string"),
    ({"lora_name": "x", "lora_path": "/x", "load_inplace": 1}, 400, "load_inplace", "boolean"),
    ({"lora_name": "x", "lora_path": "/x", "model": "other"}, 400, "model", "no engine"),
    ({"lora_name": "x", "lora_path": "/nowhere"}, 404, "lora_path", "No adapter found"),
]


async def test_bad_loads_are_answered_like_vllm_and_name_the_parameter(tmp_path: Path) -> None:
    async with running_daemon(write(tmp_path, "vllm")) as (_, client):
        for body, status, param, words in BAD_LOADS:
            response = await client.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == status, body
            error = response.json()["error"]
            assert error["param"] == param, body
            assert words in error["message"], body
        assert await output_ids(client, "tiny") == PROMPT  # the engine serves on
        assert (await output_ids(client, "x"))[0] == 404  # nothing half-loaded


@pytest.mark.parametrize(("wire", "runtime"), [("vllm", False), ("sglang", True)])
async def test_where_adapters_cannot_load_at_run_time_the_answer_says_why(
    tmp_path: Path, wire: str, runtime: bool
) -> None:
    chat = str(adapter(tmp_path, "chat"))
    async with running_daemon(write(tmp_path, wire, runtime=runtime)) as (_, client):
        response = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": chat}
        )
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert ("allow_runtime_updates" if not runtime else "cannot load LoRA") in message
        assert (await output_ids(client, "chat"))[0] == 404


async def lora_info(client: httpx.AsyncClient) -> tuple[str, str]:
    found = LORA_INFO.search((await client.get("/metrics")).text)
    assert found is not None
    return found[1], found[2]


@pytest.mark.parametrize("queue", ["admission", "engine"])
async def test_lora_requests_info_names_the_running_and_the_waiting_adapter(
    tmp_path: Path, queue: str
) -> None:
    chat = str(adapter(tmp_path, "chat"))
    # One request at a time: the second one waits in smgd's admission queue, or is sent and
    # waits in the engine's own queue (which the engine reports in its scheduler stats).
    path = write(tmp_path, "vllm", keys="max_inflight = 1\n" if queue == "admission" else "")
    if queue == "engine":
        path.write_text(
            path.read_text().replace("[engines.mock]\n", "[engines.mock]\nmax_batch = 1\n")
        )
    async with running_daemon(path) as (_, client):
        load = {"lora_name": "chat", "lora_path": chat}
        assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 200
        assert await lora_info(client) == ("", "")
        long = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            "stream": True,
        }
        async with trio.open_nursery() as nursery:
            for model in ("sql", "chat"):
                nursery.start_soon(
                    lambda m: client.post("/generate", json={**long, "model": m}), model
                )

            async def both() -> bool:  # one runs, the other waits for it
                return sorted(await lora_info(client)) == ["chat", "sql"]

            await until(both, within=30)
            nursery.cancel_scope.cancel()  # the clients leave: both requests end

        async def none() -> bool:
            return await lora_info(client) == ("", "")

        await until(none, within=30)
