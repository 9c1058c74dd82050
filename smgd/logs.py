"""Logging setup: human or JSON lines on stderr, one structured line per request at the end.

In ``json`` format every line smgd writes to stderr is one JSON object, the start-up banner
(:func:`announce`) and a fatal error included.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smgd.config import LoggingConfig

# Attributes every LogRecord has; anything else was passed in `extra=` and goes into the JSON.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None)))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


_json_lines = False  # set by setup_logging: announce() writes JSON too


def announce(text: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """A line for the operator: plain text on stderr in the human format (the banner, e.g.
    ``smgd listening on URL``, which scripts read), a log record in the JSON format."""
    if _json_lines:
        logging.getLogger("smgd").log(level, text, extra=fields)
    else:
        print(text, file=sys.stderr, flush=True)


def setup_logging(config: LoggingConfig) -> None:
    global _json_lines
    _json_lines = config.format == "json"
    handler = logging.StreamHandler(sys.stderr)
    if config.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.level.upper())
    # hypercorn's access log is separate and off unless asked for.
    logging.getLogger("hypercorn.access").disabled = not config.access_log
