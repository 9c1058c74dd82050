"""Every route's answer, byte for byte, against answers recorded from an earlier implementation.

``tests/vectors/http_answers.json`` holds the status, headers, body and request
metrics smgd answered for each case below. They were recorded at commit 1da8d34, before the
one request envelope (issue 19): the generation routes then had two implementations (the hot
path and Quart's routes) that a test kept equal byte for byte, and every other route, the
admin listener's included, was Quart's. Any change to what a client gets shows up here.

What differs between two runs is normalized: the unix second in ``created``, latencies and
uptimes (and so the length of a body with one), a minted request id, the tiny model's path,
the order of the methods in ``Allow``, and the order in which the events of an ``n > 1``
stream interleave (each choice's text and finish are compared instead). Headers are compared
as a set: the order of different fields carries no meaning (RFC 9110 §5.3), and the two old
implementations sent them in different orders.

A deliberate change: rerun with ``SMGD_RECORD_HTTP_ANSWERS=1`` (the file is rewritten from the
running code), check the diff of the JSON, and say in the commit what changed and why.
"""

from __future__ import annotations

import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from smgd.api.http.app import create_admin_app, create_app
from smgd.config import ServerConfig
from smgd.daemon import begin_drain
from smgd.reload import ReloadResult

from .asgi_client import Answer, lifespan, request
from .fake_engine import MODEL, TINY_MODEL, Behaviour, FakeEngine, open_gateway

VECTORS = Path(__file__).parent / "vectors" / "http_answers.json"
RECORD = bool(os.environ.get("SMGD_RECORD_HTTP_ANSWERS"))

Case = tuple[str, str, bytes, dict[str, str]]  # method, path (with its query), body, headers

RID = {"X-Request-Id": "rec-1"}
KEY = {**RID, "Authorization": "Bearer k1"}
STREAM = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True}
USAGE = {"include_usage": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOKENIZE = {"model": MODEL, "prompt": "Hello"}


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


GENERATION: list[Case] = [
    ("POST", "/v1/completions", _json(STREAM), RID),
    ("POST", "/v1/completions", _json({**STREAM, "stream_options": USAGE, "n": 2}), RID),
    ("POST", "/v1/completions", _json({**STREAM, "stream": False, "echo": True}), RID),
    ("POST", "/v1/chat/completions", _json(CHAT), RID),
    ("POST", "/v1/chat/completions", _json({**CHAT, "stream": True}), RID),
    ("POST", "/generate", _json({"text": "Hello", "rid": "native-7"}), RID),
    ("POST", "/generate", _json({"text": "Hello", "rid": "bad rid!"}), RID),
    ("POST", "/generate", _json({"input_ids": [1, 2], "stream": True}), RID),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', RID),
    ("POST", "/v1/completions", b"[1, 2]", RID),
    ("POST", "/v1/completions", _json({**STREAM, "model": "nope"}), RID),
    ("POST", "/v1/completions", _json({**STREAM, "temperature": 3}), RID),
    ("POST", "/v1/completions", _json({**STREAM, "max_tokens": 10**9}), RID),
    ("POST", "/v1/completions", _json(STREAM), {"X-Request-Id": "no spaces allowed"}),
    ("POST", "/v1/completions", _json(STREAM), {"X-Request-Id": "first, second"}),
    ("POST", "/v1/completions", _json(STREAM), {}),
    ("POST", "/v1/completions", b"x" * 5000, RID),  # over the 4 KiB limit: 413
]  # fmt: skip

OPS: list[Case] = [
    ("GET", "/health", b"", RID),
    ("GET", "/liveness", b"", RID),
    ("HEAD", "/health", b"", RID),
    ("OPTIONS", "/health", b"", RID),
    ("OPTIONS", "/v1/completions", b"", RID),
    ("GET", "/health", b"", {}),
    ("GET", "/health?x=1", b"", RID),
    ("GET", "/health/", b"", RID),
    ("GET", "/readiness", b"", RID),
    ("GET", "/v1/models", b"", RID),
    ("POST", "/v1/tokenize", _json(TOKENIZE), RID),
    ("POST", "/tokenize", _json(TOKENIZE), RID),
    ("POST", "/v1/tokenize", b"{", RID),
    ("POST", "/v1/tokenize", b"[1]", RID),
    ("POST", "/v1/tokenize", _json({"model": MODEL}), RID),
    ("POST", "/v1/tokenize", _json({"model": "nope", "prompt": "x"}), RID),
    ("POST", "/v1/tokenize", _json({"model": MODEL, "messages": CHAT["messages"]}), RID),
    ("POST", "/v1/detokenize", _json({"model": MODEL, "tokens": [1, 2, 3]}), RID),
    ("POST", "/detokenize", _json({"model": MODEL, "tokens": [-1]}), RID),
    ("GET", "/get_load", b"", RID),
    ("GET", "/nope", b"", RID),
    ("POST", "/nope", b"{}", RID),
    ("POST", "/v1/nope", b"{}", RID),
    ("GET", "/v1/completions", b"", RID),
    ("POST", "/health", b"{}", RID),
    ("GET", "/generate", b"", RID),
    ("PUT", "/v1/tokenize", _json(TOKENIZE), RID),
    ("DELETE", "/v1/models", b"", RID),
    ("GET", "/health", b"", {"X-Request-Id": "bad id"}),
    ("GET", "/nope", b"", {"X-Request-Id": "bad id"}),
    ("GET", "/v1/models", b"", {"X-Request-Id": "a, b"}),
    ("POST", "/v1/tokenize", b"x" * 5000, RID),
    ("POST", "/v1/detokenize", b"[" * 2500 + b"]" * 2500, RID),
    ("POST", "/nope", b"x" * 5000, RID),
    ("GET", "/metrics", b"", RID),  # the body is a scrape: its headers are compared
]

KEYED: list[Case] = [
    ("GET", "/health", b"", RID),
    ("GET", "/v1/models", b"", RID),
    ("POST", "/tokenize", _json(TOKENIZE), RID),
    ("POST", "/v1/nope", b"{}", RID),
    ("GET", "/nope", b"", RID),
    ("GET", "/metrics", b"", RID),
    ("GET", "/v1/models", b"", KEY),
    ("GET", "/v1/nope", b"", KEY),
    ("GET", "/v1/completions", b"", RID),
    ("GET", "/v1/completions", b"", KEY),
    ("POST", "/v1/completions", _json({**STREAM, "stream": False}), RID),
    ("POST", "/v1/completions", _json({**STREAM, "stream": False}), {**RID, "Authorization": "k1"}),
    ("POST", "/v1/completions", _json({**STREAM, "stream": False}), KEY),
    ("POST", "/generate", _json({**STREAM, "stream": False}), KEY),  # past the key: 400
]

DRAINING: list[Case] = [
    ("GET", "/readiness", b"", RID),
    ("POST", "/v1/tokenize", _json(TOKENIZE), RID),
    ("GET", "/v1/models", b"", RID),
    ("GET", "/health", b"", RID),
    ("POST", "/v1/completions", b"{}", RID),
    ("POST", "/v1/chat/completions", b"{}", RID),
    ("POST", "/generate", b"{}", RID),
    ("GET", "/v1/completions", b"", RID),
]

BROKEN: list[Case] = [  # the router raises an unexpected error: 500, in the envelope
    ("GET", "/get_load", b"", RID),
    ("GET", "/readiness", b"", RID),
    ("POST", "/v1/completions", _json({**STREAM, "stream": False}), RID),
    ("GET", "/health", b"", RID),
]

ADMIN: list[Case] = [
    ("GET", "/admin/engines", b"", {}),
    ("POST", "/admin/reload", b"", {}),
    ("POST", "/admin/drain", b"", {}),
    ("GET", "/admin/nope", b"", {}),
    ("GET", "/admin/drain", b"", {}),
    ("HEAD", "/admin/engines", b"", {}),
    ("OPTIONS", "/admin/drain", b"", {}),
]


def _name(case: Case) -> str:
    method, path, body, headers = case
    shown = body[:60].decode("latin-1") + ("..." if len(body) > 60 else "")
    return f"{method} {path} {shown} {json.dumps(headers)}".replace("  ", " ")


def normalized(answer: Answer) -> dict[str, Any]:
    text = answer.body.decode("latin-1")
    text = re.sub(r'"created":\d+', '"created":0', text)
    text, timed = re.subn(r'"(e2e_latency|uptime_s)":[0-9.e-]+', r'"\1":0', text)
    # The checkout's path varies (a CI clone, a worktree): the length a body has with it.
    text, moved = re.subn(re.escape(str(TINY_MODEL)), "<tiny-model>", text)
    headers = []
    for name, value in answer.headers:
        if name == "content-length":
            assert int(value) == len(answer.body)
            if timed:  # the length of a latency's digits varies
                value = "<length>"
            elif moved:
                value = str(len(answer.body) - moved * (len(str(TINY_MODEL)) - len("<tiny-model>")))
        if name == "allow":  # Quart listed the methods in set order, which varied per run
            value = ", ".join(sorted(value.split(", ")))
        if name == "x-request-id" and re.fullmatch(r"[0-9a-f]{32}", value):
            text = text.replace(value, "<minted>")
            value = "<minted>"
        headers.append([name, value])
    body: Any = text
    if (answer.header("content-type") or "").startswith("text/event-stream"):
        body = _per_choice(text)
    return {
        "status": answer.status,
        "headers": sorted(headers),
        "body": body,
        "ended": answer.ended,
    }


def _per_choice(text: str) -> Any:
    """An SSE body; for an n > 1 stream, each choice's text and finish reasons in turn."""
    events = [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    indexes = {c["index"] for chunk in chunks for c in chunk.get("choices", [])}
    if len(indexes) <= 1:
        return text
    per_choice = {
        str(i): [
            "".join(c.get("text", "") for k in chunks for c in k["choices"] if c["index"] == i),
            [c["finish_reason"] for k in chunks for c in k["choices"] if c["index"] == i],
        ]
        for i in sorted(indexes)
    }
    rest = [k for k in chunks if not k.get("choices")]
    return {"per_choice": per_choice, "rest": rest, "last": events[-1]}


COUNTED = {"smgd_http_requests", "smgd_aborts"}  # by route, method and status; refusals by cause


def request_metrics(app: Any) -> list[Any]:
    """The samples of the per-request counters (:data:`COUNTED`)."""
    families = {family.name: family for family in app.ctx.registry.collect()}
    assert families.keys() >= COUNTED  # a name that is not a real family would compare nothing
    return sorted(
        (
            [s.name, s.labels, s.value]
            for name in COUNTED
            for s in families[name].samples
            if s.name.endswith("_total")
        ),
        key=repr,
    )


async def _answers(app: Any, cases: list[Case]) -> list[dict[str, Any]]:
    out = []
    for case in cases:
        method, target, body, headers = case
        path, _, query = target.partition("?")
        answer = await request(app, method, path, body, headers, query=query.encode())
        entry = normalized(answer)
        if path == "/metrics":
            entry["body"] = "<scrape>"
            entry["headers"] = [h for h in entry["headers"] if h[0] != "content-length"]
        out.append({"case": _name(case), "answer": entry})
    return out


def check(group: str, answers: list[dict[str, Any]], metrics: list[Any] | None) -> None:
    recorded = json.loads(VECTORS.read_text()) if VECTORS.exists() else {}
    if RECORD:
        recorded[group] = {"answers": answers, "metrics": metrics}
        VECTORS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    expected = recorded[group]
    assert [a["case"] for a in answers] == [a["case"] for a in expected["answers"]]
    for got, want in zip(answers, expected["answers"], strict=True):
        assert got["answer"] == want["answer"], got["case"]
    assert metrics == expected["metrics"]


@pytest.fixture
def small_body_limit() -> ServerConfig:
    return ServerConfig(max_body_bytes=4096)


async def test_generation_routes(
    small_body_limit: ServerConfig, autojump_clock: trio.abc.Clock
) -> None:
    # The clock jumps only once every task waits: each engine step reaches the client as its
    # own event before the next one, whatever the machine's load (else events may merge).
    fake = FakeEngine(behaviour=Behaviour(step_s=0.001))
    async with open_gateway(fake, server=small_body_limit) as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            answers = await _answers(app, GENERATION)
        check("generation", answers, request_metrics(app))


async def test_ops_routes_and_refusals(small_body_limit: ServerConfig) -> None:
    async with open_gateway(server=small_body_limit) as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            answers = await _answers(app, OPS)
        check("ops", answers, request_metrics(app))


async def test_api_keys() -> None:
    async with open_gateway(server=ServerConfig(api_keys_env="KEYS")) as gateway:
        app = create_app(gateway, environ={"KEYS": "k1,k2"})
        async with lifespan(app):
            answers = await _answers(app, KEYED)
        check("keyed", answers, request_metrics(app))


async def test_draining() -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            gateway.draining = True
            answers = await _answers(app, DRAINING)
        check("draining", answers, request_metrics(app))


async def test_unexpected_errors(caplog: pytest.LogCaptureFixture) -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})

        def broken() -> Any:
            raise RuntimeError("router broken")

        working = gateway.router.engines
        async with lifespan(app):
            gateway.router.engines = broken  # type: ignore[method-assign]
            answers = await _answers(app, BROKEN)
            gateway.router.engines = working  # type: ignore[method-assign]
        check("broken", answers, request_metrics(app))
    logged = [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert len(logged) == 3  # each with its traceback, for the operator


async def test_admin_listener() -> None:
    async def reload() -> ReloadResult:
        return ReloadResult(ok=True, changed=["e0"])

    async with open_gateway() as gateway:
        app = create_admin_app(gateway, reload, partial(begin_drain, gateway))
        async with lifespan(app):
            with trio.fail_after(5):
                answers = await _answers(app, ADMIN)
        check("admin", answers, None)
