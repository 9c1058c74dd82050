"""smgd's error hierarchy.

Every error smgd raises on purpose is a :class:`SmgdError`. Each class carries the HTTP
status and the OpenAI error ``type`` the API layer answers with, so the mapping lives in one
place. The tree splits "the client's fault" from "an engine's fault"::

    SmgdError
    ├── ConfigError                 bad smgd.toml / env / flag (exit code 2, never a traceback)
    ├── ClientError                 4xx: the request is wrong; no engine is blamed
    │   ├── InvalidRequest          400 invalid_request_error (bad JSON, bad params, too long)
    │   ├── Unauthorized            401 authentication_error
    │   ├── ModelNotFound           404 not_found_error
    │   ├── PayloadTooLarge         413 invalid_request_error
    │   └── Overloaded              429 rate_limit_error (admission queue full)
    ├── EngineError                 5xx: an engine could not serve
    │   ├── EngineNotReady          503 (with Retry-After): no ready engine for the model
    │   ├── EngineDead              502: the engine died or went silent mid-request
    │   ├── EngineRejected          400/4xx: the engine refused the request (bare abort, bad input)
    │   ├── EngineTimeout           504: the engine did not finish the request in request_s
    │   └── WireError               502: a frame could not be encoded/decoded
    ├── Draining                    503: smgd is shutting down
    └── TransportError              socket-level failure (send deadline, ipc path problems)

The envelope's ``code`` follows OpenAI: a string naming the specific error
(``"context_length_exceeded"``, ``"model_not_found"``, ``"queue_full"``...) or null, never
the HTTP status (that is the response's status line).
"""

from __future__ import annotations

import errno
from typing import ClassVar


class SmgdError(Exception):
    """Base class. ``status`` and ``openai_type`` drive the HTTP error envelope."""

    status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def envelope(self) -> dict[str, object]:
        """The OpenAI error envelope for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }


class ConfigError(SmgdError):
    """An invalid configuration. ``path`` is the JSON-path style key (``$.engines[1].wire``)."""

    status = 500
    openai_type = "internal_error"

    def __init__(self, message: str, *, path: str = "$", hint: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.hint = hint

    def one_line(self) -> str:
        text = f"config error at {self.path}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text


class ClientError(SmgdError):
    status = 400
    openai_type = "invalid_request_error"


class InvalidRequest(ClientError):
    status = 400
    openai_type = "invalid_request_error"


class Unauthorized(ClientError):
    status = 401
    openai_type = "authentication_error"


class ModelNotFound(ClientError):
    status = 404
    openai_type = "not_found_error"


class PayloadTooLarge(ClientError):
    status = 413
    openai_type = "invalid_request_error"


class Overloaded(ClientError):
    status = 429
    openai_type = "rate_limit_error"
    retry_after: int = 1


class EngineError(SmgdError):
    status = 502
    openai_type = "engine_error"


class EngineNotReady(EngineError):
    status = 503
    openai_type = "service_unavailable"
    retry_after: int = 2


class EngineDead(EngineError):
    status = 502
    openai_type = "engine_error"


class EngineRejected(EngineError):
    """The engine refused the request (a 4xx-class rejection, not a crash)."""

    status = 400
    openai_type = "invalid_request_error"


class EngineTimeout(EngineError):
    """The engine did not finish a request within ``timeouts.request_s`` (it was aborted)."""

    status = 504
    openai_type = "engine_error"


class WireError(EngineError):
    status = 502
    openai_type = "engine_error"


class Draining(SmgdError):
    status = 503
    openai_type = "service_unavailable"
    retry_after: int = 5


class TransportError(SmgdError):
    status = 502
    openai_type = "engine_error"


def errno_name(number: int | None) -> str | None:
    """An OS error number as the ``code`` of an error envelope (``"EADDRINUSE"``).

    libzmq's own numbers (ETERM, EFSM...) have no name in :data:`errno.errorcode`: those read
    ``"errno <n>"``.
    """
    if number is None:
        return None
    return errno.errorcode.get(number, f"errno {number}")
