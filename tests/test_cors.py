"""CORS (smgd.api.http.cors, [server] cors_*): the headers, the preflight before auth, every
answer (errors and streams included, direct socket writes too), the config's refusals, and a
reload that changes the origins in place. A real browser drives it in test_cors_browser.py."""

from __future__ import annotations

import json

import msgspec
import pytest
import trio

from smgd.api.http.app import create_app
from smgd.api.http.cors import EXPOSED, MAX_AGE_S, CorsPolicy
from smgd.config import Config, EngineConfig, ServerConfig, WireFamily, validate
from smgd.errors import ConfigError

from .asgi_client import lifespan, request
from .fake_engine import MODEL, FakeEngine, open_gateway
from .http_helpers import post_bytes
from .test_direct import serving

UI = "http://ui.example:3000"
OTHER = "https://evil.example"
KEY_ENV = {"KEYS": "k1"}
STREAM = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True}
COMPLETION = {**STREAM, "stream": False}


def _server(**cors: object) -> ServerConfig:
    return msgspec.structs.replace(ServerConfig(), **cors)


def _config(server: ServerConfig) -> Config:
    """A config to validate: ``server`` and an engine (a config without one is refused)."""
    engine = EngineConfig(name="e", wire=WireFamily.MOCK, models=[MODEL], model_dir="m")
    return Config(server=server, engines=[engine])


def _preflight_headers(origin: str, headers: str = "authorization,content-type") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": headers,
    }


# --------------------------------------------------------------------------- the policy alone


def test_no_origin_means_no_policy() -> None:
    assert CorsPolicy.from_config(ServerConfig()) is None


def test_a_listed_origin_is_echoed_and_exposes_the_request_id() -> None:
    policy = CorsPolicy(_server(cors_allowed_origins=[UI]))
    assert policy.response_headers(UI) == {
        "Access-Control-Allow-Origin": UI,
        "Access-Control-Expose-Headers": EXPOSED,
        "Vary": "Origin",
    }
    assert "X-Request-Id" in EXPOSED


def test_an_unlisted_origin_gets_only_vary() -> None:
    policy = CorsPolicy(_server(cors_allowed_origins=[UI]))
    assert policy.response_headers(OTHER) == {"Vary": "Origin"}
    assert policy.response_headers(None) == {"Vary": "Origin"}
    assert policy.preflight_headers(OTHER, "OPTIONS, POST", None) is None


def test_the_any_origin_answers_star_without_vary() -> None:
    policy = CorsPolicy(_server(cors_allowed_origins=["*"]))
    assert policy.response_headers(OTHER)["Access-Control-Allow-Origin"] == "*"
    assert "Vary" not in policy.response_headers(OTHER)
    assert policy.response_headers(None) == {}


def test_a_preflight_echoes_the_requested_headers_under_the_star() -> None:
    policy = CorsPolicy(_server(cors_allowed_origins=[UI]))
    answer = policy.preflight_headers(UI, "OPTIONS, POST", "authorization,content-type")
    assert answer == {
        "Access-Control-Allow-Origin": UI,
        "Access-Control-Allow-Methods": "OPTIONS, POST",
        "Access-Control-Allow-Headers": "authorization,content-type",
        "Access-Control-Max-Age": str(MAX_AGE_S),
        "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
    }


def test_listed_methods_headers_and_credentials_are_answered_as_configured() -> None:
    policy = CorsPolicy(
        _server(
            cors_allowed_origins=[UI],
            cors_allowed_methods=["post", "GET"],
            cors_allowed_headers=["Authorization", "Content-Type"],
            cors_allow_credentials=True,
        )
    )
    answer = policy.preflight_headers(UI, "OPTIONS, POST", "x-custom")
    assert answer is not None
    assert answer["Access-Control-Allow-Methods"] == "POST, GET"
    assert answer["Access-Control-Allow-Headers"] == "Authorization, Content-Type"
    assert answer["Access-Control-Allow-Credentials"] == "true"
    assert policy.response_headers(UI)["Access-Control-Allow-Credentials"] == "true"


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("cors", "path"),
    [
        ({"cors_allowed_origins": ["https://ui.example/"]}, "$.server.cors_allowed_origins[0]"),
        ({"cors_allowed_origins": [UI, "ui.example"]}, "$.server.cors_allowed_origins[1]"),
        ({"cors_allowed_origins": ["https://UI.example"]}, "$.server.cors_allowed_origins[0]"),
        ({"cors_allowed_origins": ["null"]}, "$.server.cors_allowed_origins[0]"),
        ({"cors_allowed_methods": ["PO ST"]}, "$.server.cors_allowed_methods[0]"),
        ({"cors_allowed_headers": ["X-A", "a:b"]}, "$.server.cors_allowed_headers[1]"),
        (
            {"cors_allowed_origins": ["*"], "cors_allow_credentials": True},
            "$.server.cors_allow_credentials",
        ),
    ],
)
def test_cors_keys_a_browser_could_never_match_are_config_errors(
    cors: dict[str, object], path: str
) -> None:
    with pytest.raises(ConfigError) as info:
        validate(_config(_server(**cors)), check_paths=False)
    assert info.value.path == path


def test_valid_cors_keys_load() -> None:
    validate(
        _config(
            _server(
                cors_allowed_origins=[UI, "https://ui.example", "tauri://localhost"],
                cors_allowed_methods=["POST"],
                cors_allowed_headers=["Authorization"],
                cors_allow_credentials=True,
            )
        ),
        check_paths=False,
    )


# --------------------------------------------------------------------------- the dispatcher


async def test_a_preflight_is_answered_before_the_key_check() -> None:
    server = _server(cors_allowed_origins=[UI], api_keys_env="KEYS")
    async with open_gateway(server=server) as gateway:
        app = create_app(gateway, environ=KEY_ENV)
        async with lifespan(app):
            answer = await request(app, "OPTIONS", "/v1/completions", b"", _preflight_headers(UI))
            refused = await request(
                app, "OPTIONS", "/v1/completions", b"", _preflight_headers(OTHER)
            )
    assert answer.status == 204
    assert answer.body == b""
    assert answer.header("access-control-allow-origin") == UI
    assert answer.header("access-control-allow-methods") == "OPTIONS, POST"
    assert answer.header("access-control-allow-headers") == "authorization,content-type"
    assert answer.header("access-control-max-age") == str(MAX_AGE_S)
    # Not allowed: answered as any OPTIONS (here 401, no key), with no CORS header.
    assert refused.status == 401
    assert refused.header("access-control-allow-origin") is None


async def test_a_preflight_to_a_path_template_is_answered() -> None:
    async with open_gateway(server=_server(cors_allowed_origins=[UI])) as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            headers = {
                **_preflight_headers(UI, "authorization"),
                "Access-Control-Request-Method": "GET",
            }
            answer = await request(app, "OPTIONS", "/v1/models/org/tiny", b"", headers)
            unknown = await request(app, "OPTIONS", "/v1/nope", b"", headers)
    assert answer.status == 204
    assert answer.header("access-control-allow-methods") == "GET, HEAD, OPTIONS"
    # No route: no preflight answer (the browser fails the call), but the 404 is readable.
    assert unknown.status == 404
    assert unknown.header("access-control-allow-methods") is None
    assert unknown.header("access-control-allow-origin") == UI


async def test_every_answer_to_an_allowed_origin_carries_the_headers() -> None:
    server = _server(cors_allowed_origins=[UI], api_keys_env="KEYS")
    origin = {"Origin": UI, "X-Request-Id": "r1"}
    key = {**origin, "Authorization": "Bearer k1"}
    cases = [
        ("POST", "/v1/completions", COMPLETION, key, 200),
        ("POST", "/v1/completions", STREAM, key, 200),
        ("POST", "/v1/completions", COMPLETION, origin, 401),
        ("POST", "/v1/completions", {**COMPLETION, "model": "nope"}, key, 404),
        ("POST", "/v1/completions", {**COMPLETION, "max_tokens": -1}, key, 400),
        ("GET", "/v1/nope", None, key, 404),
        ("DELETE", "/v1/models", None, key, 405),
        ("GET", "/health", None, origin, 200),
    ]
    async with open_gateway(server=server) as gateway:
        app = create_app(gateway, environ=KEY_ENV)
        async with lifespan(app):
            for method, path, body, headers, status in cases:
                data = b"" if body is None else json.dumps(body).encode()
                answer = await request(app, method, path, data, headers)
                assert answer.status == status, (method, path, answer.body)
                assert answer.header("access-control-allow-origin") == UI, (path, status)
                assert answer.header("access-control-expose-headers") == EXPOSED
                assert answer.header("vary") == "Origin"
                assert answer.header("x-request-id") == "r1"
            other = await request(app, "GET", "/health", b"", {"Origin": OTHER})
    assert other.header("access-control-allow-origin") is None
    assert other.header("vary") == "Origin"


async def test_with_cors_off_no_answer_has_a_cors_header() -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            preflight = await request(
                app, "OPTIONS", "/v1/completions", b"", _preflight_headers(UI)
            )
            plain = await request(
                app, "POST", "/v1/completions", json.dumps(COMPLETION).encode(), {"Origin": UI}
            )
    assert preflight.status == 200  # the plain OPTIONS answer, as before
    for answer in (preflight, plain):
        assert not [k for k, _ in answer.headers if k.startswith("access-control") or k == "vary"]


async def test_a_reload_changes_the_origins_in_place() -> None:
    async with open_gateway(server=_server(cors_allowed_origins=[UI])) as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            before = await request(app, "GET", "/v1/models", b"", {"Origin": OTHER})
            new = msgspec.structs.replace(
                gateway.config, server=_server(cors_allowed_origins=[OTHER])
            )
            for apply in gateway.prepare_reload(new):
                apply()
            after = await request(app, "GET", "/v1/models", b"", {"Origin": OTHER})
            old = await request(app, "GET", "/v1/models", b"", {"Origin": UI})
            off = msgspec.structs.replace(gateway.config, server=ServerConfig())
            for apply in gateway.prepare_reload(off):
                apply()
            gone = await request(app, "GET", "/v1/models", b"", {"Origin": OTHER})
    assert before.header("access-control-allow-origin") is None
    assert after.header("access-control-allow-origin") == OTHER
    assert old.header("access-control-allow-origin") is None
    assert gone.header("access-control-allow-origin") is None
    assert app.cors is None


# --------------------------------------------------------------------------- the worker loop


async def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` and read until the server closes or the chunked body ends."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = bytearray()
        with trio.fail_after(10):
            while not got.endswith(b"0\r\n\r\n"):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                got += chunk
    return bytes(got)


async def test_a_directly_written_stream_carries_the_headers() -> None:
    engine = FakeEngine()
    async with serving(engine, server=_server(cors_allowed_origins=[UI])) as port:
        request_bytes = post_bytes("/v1/completions", STREAM)
        head, _, rest = request_bytes.partition(b"\r\n")
        got = await _raw(port, head + f"\r\norigin: {UI}".encode() + b"\r\n" + rest)
    head_text, _, body = got.partition(b"\r\n\r\n")
    assert head_text.startswith(b"HTTP/1.1 200")
    assert f"access-control-allow-origin: {UI}".encode() in head_text.lower()
    assert b"text/event-stream" in head_text
    assert b"data: [DONE]" in body
