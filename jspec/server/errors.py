"""OpenAI-style error bodies, and the handlers that turn every failure into one.

Every error answer of the server has OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, so the `openai` client raises its typed exception (`BadRequestError` for 400) with the
message. `param` names the request field at fault, in the caller's vocabulary: the engine's
`InvalidRequestError` messages start with the engine's field (`sampling_params.top_p: ...`,
`max_new_tokens: ...`), which each endpoint maps to its own names (`top_p`, `max_tokens`).
"""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jspec.errors import InvalidRequestError

logger = logging.getLogger("jspec.server")

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               500: "internal_server_error", 503: "service_unavailable"}


class RequestError(Exception):
    """A request the server refuses itself (status, message, param): raised by the routes."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


# ----------------------------------------------------------------------------- engine errors
_FIELD = re.compile(r"^([A-Za-z_][\w.]*): (.*)$", re.DOTALL)


def engine_field(message: str) -> tuple[str | None, str]:
    """(engine field, rest) of an `InvalidRequestError` message; (None, message) without a field."""
    m = _FIELD.match(message)
    return (m.group(1), m.group(2)) if m else (None, message)


def from_engine(exc: InvalidRequestError, names: dict[str, str] | None = None, *,
                flat_sampling: bool = False) -> RequestError:
    """A 400 from the engine's refusal, its field renamed by names (engine field -> the endpoint's
    field). flat_sampling: `sampling_params.X` becomes X (the OpenAI bodies carry them at the top)."""
    field, rest = engine_field(str(exc))
    if field is None:
        return RequestError(str(exc), None)
    param = (names or {}).get(field)
    if param is None and flat_sampling and field.startswith("sampling_params."):
        param = field.split(".", 1)[1]
    param = param or field
    return RequestError(f"{param}: {rest}", param)


# ----------------------------------------------------------------------------- validation errors
# pydantic adds the union member it tried to a location ("prompt", "list[int]", 1): such tags are
# types, not fields, and are left out of the parameter name.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|.*\[.*\]|function-.*|lax-.*|json-.*)$")


def _param(loc) -> str | None:
    parts = [p for p in loc if p != "body"]
    name = ""
    for p in parts:
        if isinstance(p, int):
            name += f"[{p}]"
        elif _TYPE_TAG.match(str(p)):
            continue
        else:
            name += ("." if name else "") + str(p)
    return name or None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first field at fault; a union's alternatives
    in one sentence."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = _param(first.get("loc", ()))
    if param is None:
        return f"the body must be a JSON object: {first.get('msg')}", None
    same = [e for e in errors if _param(e.get("loc", ())) == param]
    msgs = list(dict.fromkeys(e.get("msg", "") for e in same))
    text = msgs[0] if len(msgs) == 1 else "does not match any allowed type (" + "; ".join(msgs) + ")"
    got = first.get("input")
    if first.get("type") != "missing" and isinstance(got, (str, int, float, bool, type(None))):
        text += f", got {got!r}"
    return f"{param}: {text}", param


# ----------------------------------------------------------------------------- handlers
async def _validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(list(exc.errors()))
    return error_response(400, message, param)


async def _request_error_handler(request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _engine_error_handler(request: Request, exc: InvalidRequestError) -> JSONResponse:
    err = from_engine(exc)
    return error_response(400, err.message, err.param)


async def _http_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


class InternalErrors:
    """ASGI middleware: an exception a route did not expect becomes a 500 with an OpenAI-style body
    for that request only (the traceback goes to the log); the server and the engine go on.
    Unlike an `Exception` handler, which Starlette calls and then re-raises (uvicorn then drops the
    connection under the client), the exception stops here."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:  # noqa: BLE001 - one request fails, not the server
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if not started:  # else the response is under way: nothing to add to it
                await error_response(500, f"internal error: {type(exc).__name__}: {exc}")(scope, receive, send)


def install(app) -> None:
    """Route every failure of app to an OpenAI-style body (400 instead of FastAPI's 422). Call it
    before adding other middleware: this one must be the innermost."""
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(RequestError, _request_error_handler)
    app.add_exception_handler(InvalidRequestError, _engine_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_middleware(InternalErrors)
