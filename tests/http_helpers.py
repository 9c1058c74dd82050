"""Helpers for tests of smgd's worker loop and direct writes over real sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypercorn.trio.tcp_server import TCPServer


class SendPathCounter:
    """Counts writes that went through hypercorn's own send path (not written directly)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = TCPServer.protocol_send

        async def counting(server: Any, event: Any) -> None:
            self.count += 1
            await original(server, event)

        monkeypatch.setattr(TCPServer, "protocol_send", counting)


def dechunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked transfer, checking each chunk's framing."""
    body = bytearray()
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body += data[:size]
        assert data[size : size + 2] == b"\r\n", "a chunk is not followed by CRLF"
        data = data[size + 2 :]


def post_bytes(path: str, body: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 POST of ``body`` as JSON."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    return head + payload
