"""Golden vectors for smgd/wire/tokenspeed/, written by TokenSpeed 0.1.1's OWN code.

Every ``hex`` below comes out of TokenSpeed's encoders (``io_struct.MsgpackEncoder``,
``zmq_wire.encode``, ``MsgpackSendSocket``) run on TokenSpeed's own structs, or was captured
from TokenSpeed's engine-side transport (``zmq_msgpack.connect_msgpack_engine``) talking to a
plain pyzmq router over tcp + ipc. Nothing here imports smgd except the last live step, which
pushes smgd's ``encode_add`` frames through TokenSpeed's real ``MsgpackRecvSocket`` and records
what the engine decoded (``engine_view``).

TokenSpeed needs a GPU to *run*, but its wire modules import on CPU once torch and its kernel
packages are replaced by an import stub (no kernel ever runs; the stub classes only satisfy
``isinstance``/annotations). msgspec, numpy and pyzmq are real.

Run (about a minute, outside the repo's venv)::

    python3.11 -m venv /work/scratch-ts/venv
    /work/scratch-ts/venv/bin/pip install msgspec==0.23.0 numpy pyzmq
    /work/main/.venv/bin/pip download --no-deps tokenspeed==0.1.1 -d /work/scratch-ts
    unzip -q -o /work/scratch-ts/tokenspeed-0.1.1-py3-none-any.whl -d /work/scratch-ts/ts
    /work/scratch-ts/venv/bin/python tests/vectors/make_tokenspeed_vectors.py \\
        --wheel-dir /work/scratch-ts/ts --out tests/vectors/tokenspeed.json

Output: ``{"engine": ..., "vectors": [{name, type, fields, hex, ...}]}``; ``hex`` is one ZMQ
frame, ``fields`` is the struct in wire order (``_tag`` first for tagged structs). Request
vectors with ``smgd_request`` hold the engine-neutral request whose ``encode_add`` must equal
``hex``; ``engine_view`` is the request after TokenSpeed's own decode + finalize.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import threading
import types
from pathlib import Path
from typing import Any

# Third-party roots TokenSpeed imports that are absent (GPU stack) or irrelevant to the wire.
STUB_ROOTS = {
    "torch", "tokenspeed_kernel", "tokenspeed_triton", "triton", "transformers", "psutil",
    "pybase64", "requests", "PIL", "pydantic", "starlette", "setproctitle", "xgrammar",
    "tokenspeed_scheduler", "safetensors", "huggingface_hub", "tqdm", "filelock", "yaml",
    "jinja2", "fastapi", "uvicorn", "aiohttp", "orjson", "partial_json_parser",
    "prometheus_client", "sentencepiece", "openai", "einops",
}  # fmt: skip


class _Anything(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls


_STUBS: dict[str, type] = {}


def _stub_class(name: str) -> type:
    if name not in _STUBS:
        _STUBS[name] = _Anything(name, (), {})
    return _STUBS[name]


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in STUB_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def load_tokenspeed(wheel_dir: Path) -> dict[str, Any]:
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, str(wheel_dir))
    from tokenspeed.runtime.engine import (  # type: ignore[import-not-found]
        io_struct,
        request_types,
        zmq_msgpack,
        zmq_wire,
    )
    from tokenspeed.runtime.sampling import sampling_params  # type: ignore[import-not-found]

    return {
        "io": io_struct,
        "rt": request_types,
        "zm": zmq_msgpack,
        "zw": zmq_wire,
        "sp": sampling_params,
    }


def fields_of(obj: Any) -> Any:
    """A struct → builtins in wire order, ``_tag`` first for tagged structs."""
    import msgspec

    if isinstance(obj, msgspec.Struct):
        out: dict[str, Any] = {}
        tag = type(obj).__struct_config__.tag
        if tag is not None:
            out["_tag"] = tag
        for name in obj.__struct_fields__:
            out[name] = fields_of(getattr(obj, name))
        return out
    if isinstance(obj, set):
        return sorted(obj)
    if isinstance(obj, list | tuple):
        return [fields_of(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): fields_of(v) for k, v in obj.items()}
    return obj


def build(ts: dict[str, Any]) -> list[dict[str, Any]]:
    io, sp, zw, rt = ts["io"], ts["sp"], ts["zw"], ts["rt"]
    SP, Req, Slim = sp.SamplingParams, io.TokenizedGenerateReqInput, io.BatchTokenIDOutSlim
    enc = io.MsgpackEncoder()
    vectors: list[dict[str, Any]] = []

    def add(name: str, type_: str, obj: Any, frame: bytes, **extra: Any) -> None:
        vectors.append({"name": name, "type": type_, "fields": fields_of(obj), "hex": frame.hex()})
        vectors[-1].update(extra)

    def payload(obj: Any) -> bytes:
        frames = enc.encode(obj)
        assert len(frames) == 1, "text-path structs never produce aux frames"
        return bytes(frames[0])

    def engine_view(frame: bytes) -> Any:
        (decoded,) = zw.decode_request_frames([zw.REQ_TYPE_ADD, frame])
        return fields_of(decoded)

    add("req_type_add", "RequestTypeFrame", {"value": "ADD"}, zw.REQ_TYPE_ADD)
    add("req_type_abort", "RequestTypeFrame", {"value": "ABORT"}, zw.REQ_TYPE_ABORT)

    # Requests. smgd_request: what smgd would send for the same ask (encode_add must match).
    requests: list[tuple[str, Any, dict[str, Any] | None]] = [
        (
            "req_default_sampling",
            Req(rid="req-1", input_ids=[1, 2, 3], sampling_params=SP()),
            None,
        ),
        (
            "req_minimal_prefix_fields",
            Req(rid="r", input_ids=[5], sampling_params=SP(max_new_tokens=1)),
            None,
        ),
        (
            "req_smgd_greedy",
            Req(
                rid="greedy-1",
                input_ids=[101, 7592, 2088],
                sampling_params=SP(max_new_tokens=16, temperature=0.0, stop_token_ids=[2, 9]),
                stream=True,
            ),
            {
                "rid": "greedy-1",
                "prompt_ids": [101, 7592, 2088],
                "stream": True,
                "sampling": {"max_tokens": 16, "temperature": 0.0, "stop_token_ids": [2, 9]},
            },
        ),
        (
            "req_smgd_sampled_seeded",
            Req(
                rid="samp-7",
                input_ids=[70000, 65536, 1, 131071],
                sampling_params=SP(
                    max_new_tokens=64,
                    temperature=0.7,
                    top_p=0.9,
                    top_k=40,
                    min_p=0.05,
                    frequency_penalty=0.5,
                    presence_penalty=-0.25,
                    repetition_penalty=1.1,
                    min_new_tokens=2,
                    seed=1234,
                    ignore_eos=True,
                ),
                stream=False,
            ),
            {
                "rid": "samp-7",
                "prompt_ids": [70000, 65536, 1, 131071],
                "stream": False,
                "sampling": {
                    "max_tokens": 64,
                    "temperature": 0.7,
                    "top_p": 0.9,
                    "top_k": 40,
                    "min_p": 0.05,
                    "frequency_penalty": 0.5,
                    "presence_penalty": -0.25,
                    "repetition_penalty": 1.1,
                    "min_tokens": 2,
                    "seed": 1234,
                    "ignore_eos": True,
                },
            },
        ),
        (
            "req_smgd_logprobs_bias",
            Req(
                rid="lp-1",
                input_ids=[3, 4],
                sampling_params=SP(max_new_tokens=4, logit_bias={"17": -100.0, "5": 2.5}),
                return_logprob=True,
                stream=True,
            ),
            {
                "rid": "lp-1",
                "prompt_ids": [3, 4],
                "stream": True,
                "sampling": {
                    "max_tokens": 4,
                    "logprobs": 0,
                    "logit_bias": {"17": -100.0, "5": 2.5},
                },
            },
        ),
        (
            "req_smgd_json_schema",
            Req(
                rid="js-1",
                input_ids=[5, 6, 7],
                sampling_params=SP(
                    max_new_tokens=16, temperature=0.0, json_schema='{"type":"object"}'
                ),
            ),
            {
                "rid": "js-1",
                "prompt_ids": [5, 6, 7],
                "stream": False,
                "sampling": {
                    "max_tokens": 16,
                    "temperature": 0.0,
                    "structured": {
                        "kind": "json",
                        "param": "sampling_params.json_schema",
                        "spec": '{"type":"object"}',
                    },
                },
            },
        ),
        (
            "req_smgd_regex",
            Req(rid="re-1", input_ids=[5], sampling_params=SP(max_new_tokens=8, regex="[a-z]+")),
            {
                "rid": "re-1",
                "prompt_ids": [5],
                "stream": False,
                "sampling": {
                    "max_tokens": 8,
                    "structured": {"kind": "regex", "param": "guided_regex", "spec": "[a-z]+"},
                },
            },
        ),
        (
            "req_smgd_ebnf",
            Req(
                rid="eb-1", input_ids=[5], sampling_params=SP(max_new_tokens=8, ebnf='root ::= "a"')
            ),
            {
                "rid": "eb-1",
                "prompt_ids": [5],
                "stream": False,
                "sampling": {
                    "max_tokens": 8,
                    "structured": {
                        "kind": "grammar",
                        "param": "sampling_params.ebnf",
                        "spec": 'root ::= "a"',
                    },
                },
            },
        ),
        (
            "req_stop_strings_structured",
            Req(
                rid="st-1",
                input_ids=[9, 9, 9],
                sampling_params=SP(
                    max_new_tokens=32,
                    stop=["\n\n", "END"],
                    json_schema='{"type":"object"}',
                    stream_interval=4,
                    custom_params={"k": [1, 2]},
                ),
            ),
            None,
        ),
        (
            "req_all_optional_top_fields",
            Req(
                rid="all-1",
                http_worker_ipc="ipc:///tmp/w",
                input_text="héllo",
                input_ids=[1, 2],
                sampling_params=SP(max_new_tokens=2, n=1),
                logprob_start_len=1,
                token_ids_logprob=[4],
                session_params=io.SessionParams(id="s", rid="p", offset=3, replace=True),
                custom_logit_processor="clp",
                return_hidden_states=True,
                created_time=1750000000.25,
                bootstrap_host="10.0.0.1",
                bootstrap_port=8998,
                bootstrap_room=2**40,
                input_multi_ids=[[1], [2]],
                input_extra_infos=[{"a": 1}],
                input_ids_unpadded=[1, 2],
                validation_error=None,
                data_parallel_rank=3,
            ),
            None,
        ),
        (
            "req_unicode_rid_empty_prompt",
            Req(rid="zß水🙂", input_ids=[], sampling_params=SP(max_new_tokens=0)),
            None,
        ),
        (
            "req_n2_rejected_by_engine",
            Req(rid="n2", input_ids=[1], sampling_params=SP(max_new_tokens=3, n=2)),
            None,
        ),
        (
            "req_int_in_float_slots",
            Req(rid="ints", input_ids=[1], sampling_params=SP(top_p=1, repetition_penalty=2)),
            None,
        ),
    ]
    for name, req, smgd_request in requests:
        frame = payload(req)
        extra: dict[str, Any] = {"engine_view": engine_view(frame)}
        if smgd_request is not None:
            extra["smgd_request"] = smgd_request
        add(name, "TokenizedGenerateReqInput", req, frame, **extra)

    for name, params in [
        ("sampling_default_api_form", SP()),
        ("sampling_greedy_api_form", SP(temperature=0.0, max_new_tokens=5)),
    ]:
        add(name, "SamplingParams", params, payload(params))
    normalized = SP(max_new_tokens=8, stop="x")
    normalized.resolve_seed("req-1")
    normalized.normalize(tokenizer=None)
    add("sampling_normalized", "SamplingParams", normalized, payload(normalized))

    for name, rids in [("abort_one", ["req-1"]), ("abort_many", ["a", "b-2", "水"])]:
        add(name, "AbortPayload", rids, zw.encode(rids))

    outputs = [
        (
            "out_single_midstream",
            Slim(
                rids=["req-1"],
                output_ids=[[791]],
                finished_reasons=[""],
                prompt_tokens=[6],
                completion_tokens=[1],
                cached_tokens=[0],
                output_token_logprobs_val=[[]],
                output_token_logprobs_idx=[[]],
            ),
        ),
        (
            "out_two_reqs_one_stop_with_load",
            Slim(
                rids=["a", "b"],
                output_ids=[[11, 12], [2]],
                finished_reasons=["", "stop"],
                prompt_tokens=[3, 40],
                completion_tokens=[5, 9],
                cached_tokens=[0, 32],
                output_token_logprobs_val=[[], []],
                output_token_logprobs_idx=[[], []],
                num_running=7,
                num_waiting=2,
                kv_active_pages=120,
                kv_total_pages=1000,
            ),
        ),
        (
            "out_length_with_logprobs",
            Slim(
                rids=["vec-1"],
                output_ids=[[10, 11]],
                finished_reasons=["length"],
                prompt_tokens=[3],
                completion_tokens=[2],
                cached_tokens=[1],
                output_token_logprobs_val=[[-0.5, -0.25]],
                output_token_logprobs_idx=[[10, 11]],
                engine_index=1,
                num_running=2,
                num_waiting=5,
                kv_active_pages=100,
                kv_total_pages=400,
            ),
        ),
        (
            "out_abort_empty_tokens",
            Slim(
                rids=["bad"],
                output_ids=[[]],
                finished_reasons=["abort"],
                prompt_tokens=[4],
                completion_tokens=[0],
                cached_tokens=[0],
                output_token_logprobs_val=[[]],
                output_token_logprobs_idx=[[]],
            ),
        ),
        (
            "out_engine_index_3_large_values",
            Slim(
                rids=["x" * 40],
                output_ids=[[4294967295, 0, 65535]],
                finished_reasons=[""],
                prompt_tokens=[1 << 20],
                completion_tokens=[3],
                cached_tokens=[1 << 19],
                output_token_logprobs_val=[[-1e-9, -30.0, 0.0]],
                output_token_logprobs_idx=[[4294967295, 0, 65535]],
                engine_index=3,
                num_running=65536,
                num_waiting=300,
                kv_active_pages=1 << 33,
                kv_total_pages=1 << 34,
            ),
        ),
    ]
    for name, slim in outputs:
        add(name, "BatchTokenIDOutSlim", slim, payload(slim))

    # The real engine path: a full BatchTokenIDOut with FINISH_* to_json() dicts, sliced by
    # TokenSpeed's own from_full exactly as MsgpackSendSocket does.
    full = full_batch(io, rt)
    slim = Slim.from_full(full, engine_index=2, num_running=3, num_waiting=0,
                          kv_active_pages=9, kv_total_pages=64)  # fmt: skip
    add("out_from_full_mixed_finish", "BatchTokenIDOutSlim", slim, payload(slim))

    hello = zw.WireReadyMessage(status="HELLO", local=True, headless=True)
    ready = zw.WireReadyMessage(status="READY", local=True, headless=True)
    init = zw.WireHandshakeInitMessage(
        addresses=zw.WireHandshakeAddresses(
            inputs=["ipc:///tmp/smgd-0/ts-in.sock"], outputs=["ipc:///tmp/smgd-0/ts-out.sock"]
        )
    )
    add("handshake_hello", "WireReadyMessage", hello, zw.encode(hello))
    add("handshake_ready", "WireReadyMessage", ready, zw.encode(ready))
    add("handshake_init_ipc", "WireHandshakeInitMessage", init, zw.encode(init))
    add("registration_ready_response", "WireEngineCoreReadyResponse", registration(zw),
        zw.encode(registration(zw)))  # fmt: skip
    for index in (0, 1, 258):
        ident = ts["zm"]._engine_identity(index)
        add(f"engine_identity_{index}", "EngineIdentity", {"engine_index": index}, ident)
    add("engine_core_dead", "EngineCoreDeadSentinel", {}, ts["zm"].ENGINE_CORE_DEAD)
    return vectors


def full_batch(io: Any, rt: Any) -> Any:
    n = 3
    return io.BatchTokenIDOut(
        rids=["f-0", "f-1", "f-2"],
        finished_reasons=[
            None,
            rt.FINISH_MATCHED_TOKEN(matched=2).to_json(),
            rt.FINISH_LENGTH(length=16).to_json(),
        ],
        decoded_texts=["", "", ""],
        decode_ids=[[1, 2], [3], [4]],
        read_offsets=[0, 0, 0],
        output_ids=[[500, 501], [2], [77]],
        output_multi_ids=None,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        prompt_tokens=[10, 11, 12],
        completion_tokens=[2, 8, 16],
        cached_tokens=[0, 0, 8],
        spec_verify_ct=[0] * n,
        input_token_logprobs_val=[[]] * n,
        input_token_logprobs_idx=[[]] * n,
        output_token_logprobs_val=[[-0.125, -2.0], [-0.5], [-3.75]],
        output_token_logprobs_idx=[[500, 501], [2], [77]],
        input_top_logprobs_val=[[]] * n,
        input_top_logprobs_idx=[[]] * n,
        output_top_logprobs_val=[[]] * n,
        output_top_logprobs_idx=[[]] * n,
        input_token_ids_logprobs_val=[[]] * n,
        input_token_ids_logprobs_idx=[[]] * n,
        output_token_ids_logprobs_val=[[]] * n,
        output_token_ids_logprobs_idx=[[]] * n,
        output_hidden_states=[[]] * n,
        batch_accept_draft_tokens=[None] * n,
        output_extra_infos=[{}] * n,
        generated_time=0.0,
    )


def registration(zw: Any) -> Any:
    return zw.WireEngineCoreReadyResponse(
        max_model_len=32768, num_gpu_blocks=4096, prefix_granularity=64, dtype="bfloat16",
        vllm_version="tokenspeed-0.1.1", world_size=1, data_parallel_size=1,
        tensor_parallel_size=1, data_parallel_rank=0, max_num_seqs=256,
        max_num_batched_tokens=8192, instance_id="tiny-model", kv_cache_size_tokens=262144,
    )  # fmt: skip


def live(ts: dict[str, Any], repo: Path) -> list[dict[str, Any]]:
    """TokenSpeed's engine-side transport against a bare pyzmq router; smgd frames go in."""
    import tempfile

    import zmq

    zm, zw, io, rt = ts["zm"], ts["zw"], ts["io"], ts["rt"]
    sys.path.insert(0, str(repo))
    from smgd.wire.common import GenerateRequest, SamplingParams, Structured, StructuredKind
    from smgd.wire.tokenspeed import encode as smgd_ts  # pure msgspec; no trio/zmq import

    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="ts-live-")
    hs, inp, out = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    for s in (hs, inp, out):
        s.setsockopt(zmq.LINGER, 0)
    inp.bind(f"ipc://{tmp}/in.sock")
    out.bind(f"ipc://{tmp}/out.sock")
    port = hs.bind_to_random_port("tcp://127.0.0.1")
    result: dict[str, Any] = {}

    def engine() -> None:
        result["sockets"] = zm.connect_msgpack_engine(
            ctx, f"tcp://127.0.0.1:{port}", 7, registration(zw), 152064,
            enable_output_logprobs=False, supports_prompt_logprobs=False,
        )  # fmt: skip

    thread = threading.Thread(target=engine)
    thread.start()
    captured: list[dict[str, Any]] = []
    ident, hello = hs.recv_multipart()
    hs.send_multipart(
        [ident, *smgd_ts.encode_init([f"ipc://{tmp}/in.sock"], [f"ipc://{tmp}/out.sock"])]
    )
    ident2, ready = hs.recv_multipart()
    ident3, reg = inp.recv_multipart()
    thread.join(10)
    assert ident == ident2 == ident3 == b"\x07\x00", (ident, ident2, ident3)
    captured += [
        {"name": "live_hello", "type": "WireReadyMessage", "hex": hello.hex()},
        {"name": "live_ready", "type": "WireReadyMessage", "hex": ready.hex()},
        {"name": "live_registration", "type": "WireEngineCoreReadyResponse", "hex": reg.hex()},
        {"name": "live_identity_7", "type": "EngineIdentity", "hex": ident.hex()},
    ]
    recv_sock, send_sock = result["sockets"]

    def req(rid: str, **sampling: Any) -> GenerateRequest:
        logprobs = sampling.pop("logprobs", None)
        sampling_params = SamplingParams(max_tokens=8, logprobs=logprobs, **sampling)
        return GenerateRequest(rid=rid, prompt_ids=[1, 2, 3], sampling=sampling_params)

    sent = [
        ("live_add_greedy", req("g-1", temperature=0.0)),
        ("live_add_sampled_unseeded", req("s-1", temperature=0.8, top_p=0.95)),
        ("live_add_logprobs_disabled_server", req("lp-1", logprobs=0)),
        (
            "live_add_json_object",
            req("jo-1", structured=Structured(kind=StructuredKind.JSON_OBJECT, param="p")),
        ),
    ]
    for name, r in sent:
        frames = smgd_ts.encode_add(r)
        inp.send_multipart([ident, *frames])
        got = recv_sock.recv_pyobj()
        captured.append({
            "name": name, "type": "TokenizedGenerateReqInput", "hex": frames[1].hex(),
            "engine_view": fields_of(got),
        })  # fmt: skip
    inp.send_multipart([ident, *smgd_ts.encode_abort(["g-1", "s-1"])])
    aborts = [recv_sock.recv_pyobj(), recv_sock.recv_pyobj()]
    assert [a.rid for a in aborts] == ["g-1", "s-1"]
    assert all(isinstance(a, io.AbortReq) for a in aborts)
    full = full_batch(io, rt)
    send_sock.set_load_snapshot(4, 1, 30, 120)
    send_sock.send_pyobj(full)
    (frame,) = out.recv_multipart()
    captured.append(
        {"name": "live_output_from_send_socket", "type": "BatchTokenIDOutSlim", "hex": frame.hex()}
    )
    send_sock.send_engine_dead()
    (dead,) = out.recv_multipart()
    captured.append(
        {"name": "live_engine_core_dead", "type": "EngineCoreDeadSentinel", "hex": dead.hex()}
    )
    for s in (hs, inp, out):
        s.close()
    recv_sock.close()
    send_sock.close()
    ctx.term()
    return captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", type=Path, required=True, help="unpacked tokenspeed wheel")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-live", action="store_true", help="skip the transport capture")
    args = parser.parse_args()
    ts = load_tokenspeed(args.wheel_dir)
    vectors = build(ts)
    if not args.no_live:
        vectors += live(ts, Path(__file__).resolve().parents[2])
    doc = {
        "engine": "tokenspeed 0.1.1 (PyPI wheel), msgspec " + __import__("msgspec").__version__,
        "generator": "tests/vectors/make_tokenspeed_vectors.py",
        "vectors": vectors,
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(vectors)} vectors to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
