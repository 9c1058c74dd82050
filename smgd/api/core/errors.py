"""Errors as HTTP: the OpenAI envelope, status codes, ``Retry-After``, and SSE error events.

Every 4xx/5xx smgd answers is ``{"error": {"message", "type", "param", "code"}}``. Before the
first byte of a stream the error is a real HTTP status; after it, an ``data: {"error": ...}``
event followed by ``data: [DONE]`` (so a client never mistakes a cut stream for success).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from smgd.api.core.sse import DONE, encode_json, event
from smgd.errors import EngineDead, EngineRejected, SmgdError
from smgd.wire.common import Finish, FinishReason

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "HTTP_ERRORS",
    "engine_finish_error",
    "error_body",
    "error_headers",
    "http_error",
    "stream_error",
]

# Statuses answered without a SmgdError → OpenAI error types: the dispatcher's own refusals
# (404, 405, 408: smgd.api.http.dispatch) and the requests h11 refuses (400, 431, 501, 505:
# smgd.api.http.worker_loop).
HTTP_ERRORS: Mapping[int, str] = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    431: "invalid_request_error",
    501: "invalid_request_error",  # h11: a transfer coding it does not implement; the client's
    505: "invalid_request_error",  # an HTTP version other than 1.x (HTTP/2's preface): the client's
}


def error_body(err: SmgdError) -> bytes:
    return encode_json(err.envelope())


def error_headers(err: SmgdError, request_id: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    retry_after = getattr(err, "retry_after", None)
    if isinstance(retry_after, int) and err.status in (429, 503):
        headers["Retry-After"] = str(retry_after)
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return headers


def http_error(status: int, message: str) -> bytes:
    """Envelope for an error that is not a :class:`SmgdError` (:data:`HTTP_ERRORS`)."""
    kind = HTTP_ERRORS.get(status, "internal_error" if status >= 500 else "invalid_request_error")
    return encode_json({"error": {"message": message, "type": kind, "param": None, "code": None}})


def stream_error(err: SmgdError) -> bytes:
    """The mid-stream form: an error event, then ``[DONE]``."""
    return event(err.envelope()) + DONE


def engine_finish_error(finish: Finish) -> SmgdError:
    """An engine-side ABORT/ERROR finish the client did not ask for, as an error.

    The engine's own status code picks the class (and so the HTTP status); it is not the
    envelope's ``code``, which is a string or null.
    """
    message = finish.message or f"the engine ended the request ({finish.reason.value})"
    status = finish.status_code
    if finish.reason is FinishReason.ABORT and (status is None or 400 <= status < 500):
        return EngineRejected(message, param=finish.param)
    return EngineDead(message)
