"""Structured logging: key=value (default) or JSON lines, selectable at start.

Log calls pass fields as ``extra={"fields": {...}}`` or through `log_fields`; values that look like
secrets (tokens, passwords, authorization headers) are never printed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

_SECRET_KEYS = ("token", "password", "secret", "authorization", "bearer", "key_data", "cert_data")
_RESERVED = set(vars(logging.makeLogRecord({})))


def _redact(key: str, value: object) -> object:
    return "<redacted>" if any(s in key.lower() for s in _SECRET_KEYS) else value


def _fields(record: logging.LogRecord) -> dict[str, object]:
    fields: dict[str, object] = {}
    extra = getattr(record, "fields", None)
    if isinstance(extra, Mapping):
        fields.update(extra)
    for key, value in vars(record).items():
        if key not in _RESERVED and key not in ("fields", "message", "asctime"):
            fields[key] = value
    return {k: _redact(k, v) for k, v in fields.items()}


def _logfmt_value(value: object) -> str:
    text = str(value)
    if text == "" or any(ch in text for ch in ' ="\n\t'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=agent.kube.publisher msg="..." key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        parts = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        parts.update({k: v for k, v in _fields(record).items()})  # type: ignore[misc]
        line = " ".join(f"{k}={_logfmt_value(v)}" for k, v in parts.items())
        if record.exc_info:
            line += " error=" + _logfmt_value(self.formatException(record.exc_info).splitlines()[-1])
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        data.update(_fields(record))
        if record.exc_info:
            data["error"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


LOG_FORMATS = ("keyvalue", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


def setup_logging(fmt: str = "keyvalue", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure the root logger once for the process."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp.access", "grpclib", "hpack", "kubernetes_asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def log_fields(**fields: object) -> dict[str, dict[str, object]]:
    """``logger.info("msg", extra=log_fields(device="gpu-0"))``."""
    return {"fields": fields}
