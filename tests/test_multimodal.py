"""Multimodal input is out of smgd's scope: media content parts are a 400 that names the part
and says why (the model's processor, torch), never a 500 or a silently dropped image."""

from __future__ import annotations

import json
from typing import Any

import pytest

from smgd.api.http.app import create_app

from .asgi_client import lifespan, request
from .fake_engine import MODEL, open_gateway

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
TEXT = {"type": "text", "text": "What is this?"}


async def _post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            answer = await request(app, "POST", path, json.dumps(body).encode())
    return answer.status, json.loads(answer.body)


@pytest.mark.parametrize("part", [IMAGE, AUDIO])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_media_part_in_chat_is_a_400_that_says_why(
    part: dict[str, Any], stream: bool
) -> None:
    messages = [
        {"role": "system", "content": "You describe things."},
        {"role": "user", "content": [TEXT, part]},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": stream}
    status, answer = await _post("/v1/chat/completions", body)
    assert status == 400
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages[1].content[1].type"
    assert part["type"] in error["message"]
    assert "multimodal input" in error["message"]
    assert "processor" in error["message"] and "docs/design.md" in error["message"]


async def test_a_media_part_as_a_completions_prompt_is_named() -> None:
    body = {"model": MODEL, "prompt": ["Describe:", IMAGE], "max_tokens": 4}
    status, answer = await _post("/v1/completions", body)
    assert status == 400
    assert answer["error"]["param"] == "prompt[1].type"
    assert "multimodal input" in answer["error"]["message"]


@pytest.mark.parametrize("kind", [["image_url"], {"a": 1}, None, 3])
async def test_a_part_type_that_is_no_string_is_a_400(kind: object) -> None:
    """A list or object as the type once reached a set lookup and answered 500."""
    messages = [{"role": "user", "content": [{"type": kind, "text": "x"}]}]
    status, answer = await _post(
        "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4}
    )
    assert status == 400
    assert answer["error"]["param"] == "messages[0].content[0].type"
