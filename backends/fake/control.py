"""The fake backend's control socket: inject, recover, lose, list and scenarios at run time.

Protocol: a Unix stream socket; one JSON object per line each way. Requests::

    {"op": "inject", "device": "gpu-3", "condition": "xid", "value": "79",
     "driver": null, "severity": null, "kind": null, "message": ""}
    {"op": "recover", "device": "gpu-3", "condition": null}
    {"op": "lose", "device": "gpu-3"}
    {"op": "list"}
    {"op": "scenario", "scenario": {"steps": [...]}}      # answered when the run ends

Replies are ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "one line"}``. Bad input
(malformed JSON, an unknown device, a bad field) gets an error reply; it never stops the server.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from typing import Any, Protocol

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from agent.core.clock import Clock
from agent.core.errors import BackendError
from agent.core.logs import log_fields
from backends.fake.scenario import (
    FaultController,
    ScenarioError,
    parse_kind,
    parse_scenario,
    parse_severity,
    run_scenario,
)

log = logging.getLogger("agent.fake.control")

MAX_REQUEST_BYTES = 1 << 20
OPS = ("inject", "recover", "lose", "list", "scenario")


class ControlError(BackendError):
    """The control socket cannot be used (nobody listens, it is taken, or the reply is broken)."""


class ControlTarget(FaultController, Protocol):
    """What the control server drives: fault injection plus a listing of the devices."""

    def snapshot(self) -> list[dict[str, object]]: ...


def unlink_socket(path: str) -> None:
    """Remove a socket file if it is there (and is a socket)."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        log.warning("cannot remove control socket", extra=log_fields(path=path, error=str(error)))


async def _claim_path(path: str) -> None:
    """Refuse a socket another live process serves; remove a stale one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlError(f"control socket path {path} exists and is not a socket; set control=PATH")
    try:
        with anyio.fail_after(1):
            stream = await anyio.connect_unix(path)
    except (OSError, TimeoutError):
        unlink_socket(path)
        return
    await stream.aclose()
    raise ControlError(
        f"control socket {path} is served by another running agent; give this one another with control=PATH"
    )


async def serve_control(target: ControlTarget, path: str, clock: Clock) -> None:
    """Serve the control socket at `path` until cancelled; the file is removed on the way out."""
    await _claim_path(path)
    # Owner-only: whoever can connect can fake GPU faults on this node.
    listener = await anyio.create_unix_listener(path, mode=0o600)
    log.info("fake control socket listening", extra=log_fields(path=path))
    try:
        async with listener, anyio.create_task_group() as tg:

            async def serve_one(stream: SocketStream) -> None:
                await _serve_connection(target, stream, clock)

            await listener.serve(serve_one, task_group=tg)
    finally:
        unlink_socket(path)


async def _serve_connection(target: ControlTarget, stream: SocketStream, clock: Clock) -> None:
    receiver = BufferedByteReceiveStream(stream)
    try:
        async with stream:
            while True:
                try:
                    line = await receiver.receive_until(b"\n", MAX_REQUEST_BYTES)
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    return
                except anyio.DelimiterNotFound:
                    await _send(stream, _error(f"request longer than {MAX_REQUEST_BYTES} bytes"))
                    return
                if line.strip():
                    await _send(stream, await handle_request(target, line, clock))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
        return  # the client went away
    except Exception as error:  # bad input must never stop the agent
        log.error("control connection failed", extra=log_fields(error=f"{type(error).__name__}: {error}"))


async def _send(stream: SocketStream, reply: Mapping[str, Any]) -> None:
    await stream.send(json.dumps(reply).encode() + b"\n")


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def _text(request: Mapping[str, Any], key: str, *, required: bool = False) -> str | None:
    value = request.get(key)
    if value is None:
        if required:
            raise ValueError(f"field {key!r} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"field {key!r} must be a string, not {value!r}")
    return str(value)


async def handle_request(target: ControlTarget, line: bytes, clock: Clock) -> dict[str, Any]:
    """Answer one request line; every failure becomes an error reply."""
    try:
        request = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8"
        return _error(f"malformed request ({reason}): send one JSON object per line")
    if not isinstance(request, dict):
        return _error("malformed request: send one JSON object per line")
    op = request.get("op")
    try:
        if op == "list":
            return {"ok": True, "result": target.snapshot()}
        if op == "scenario":
            scenario = parse_scenario(request.get("scenario"), "request")
            result = await run_scenario(target, scenario, clock)
            return {"ok": True, "result": result.as_dict()}
        if op not in OPS:
            return _error(f"unknown op {op!r}; ops are {', '.join(OPS)}")
        device = _text(request, "device", required=True) or ""
        driver = _text(request, "driver")
        if op == "inject":
            affected = await target.inject(
                device,
                _text(request, "condition", required=True) or "",
                _text(request, "value") or "",
                driver=driver,
                severity=parse_severity(request.get("severity")),
                kind=parse_kind(request.get("kind")),
                message=_text(request, "message") or "",
            )
        elif op == "recover":
            affected = await target.recover(device, _text(request, "condition"), driver=driver)
        else:
            affected = await target.lose(device, driver=driver)
        log.info("fault control", extra=log_fields(op=op, device=device, affected=len(affected)))
        return {"ok": True, "result": affected}
    except (ScenarioError, BackendError) as error:
        return _error(str(error))
    except (KeyError, ValueError) as error:
        text = error.args[0] if error.args else error
        return _error(f"bad {op} request: {text} (severity: info|warning|critical, kind: event|state)")
    except Exception as error:  # a bug here must not stop the agent: answer and log it
        log.exception("fake control request failed", extra=log_fields(op=str(op)))
        return _error(f"internal error in the fake backend: {type(error).__name__}: {error}")


async def request(path: str, payload: Mapping[str, Any], *, wait: float | None = 10.0) -> Any:
    """Send one request to the control socket at `path`; return its result or raise the error it names."""
    try:
        stream = await anyio.connect_unix(path)
    except OSError as error:
        raise ControlError(
            f"cannot reach the fake backend's control socket {path} ({error.strerror or error}); "
            "is 'dra-agent run' with the fake backend running? (choose the socket with --socket)"
        ) from None
    async with stream:
        with anyio.fail_after(wait):
            await stream.send(json.dumps(payload).encode() + b"\n")
            receiver = BufferedByteReceiveStream(stream)
            try:
                line = await receiver.receive_until(b"\n", MAX_REQUEST_BYTES * 16)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound):
                raise ControlError(f"the agent closed the control socket {path} without an answer") from None
    try:
        reply = json.loads(line)
    except json.JSONDecodeError:
        raise ControlError(f"the agent sent a malformed reply on {path}") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise ControlError(str(reply.get("error") if isinstance(reply, dict) else reply))
    return reply.get("result")
