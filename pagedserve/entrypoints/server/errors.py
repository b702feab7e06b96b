"""OpenAI-style error bodies for every failure, so clients never see a bare 500 or 422.

OpenAI answers bad input with 400 and `{"error": {"message", "type", "param", "code"}}`;
its SDKs map the status to an exception class and read `message`. FastAPI's own validation
errors (wrong types, out-of-range values, malformed JSON) are converted to the same shape
with status 400, since to a client they are all "invalid request".

Unknown model names get 404 `model_not_found`, as OpenAI returns; everything else a client
can get wrong is 400: a field the server does not know (`unknown_parameter`), a body that is
not JSON (the message says where it breaks), not UTF-8 (json.loads would guess UTF-16 or
UTF-32 from the first bytes; RFC 8259 asks for UTF-8 between systems, and a guess is how a
proxy and the server come to read different requests). The OpenAPI document says so: its 422
responses, which FastAPI declares for every body, are declared as these 400s.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.entrypoints.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error with the status and OpenAI fields to answer it with."""

    def __init__(self, message: str, status: int = 400, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message, status, type, param, code)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, INVALID_REQUEST, param, code)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, INVALID_REQUEST, "model",
                    "model_not_found")


def _validation_error(exc: RequestValidationError, content_type: str) -> APIError:
    """The first validation problem as one readable message naming the parameter."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return _json_error(err, exc.body)
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # union members show up as extra location parts (e.g. prompt.str); keep the field path
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    ctx = err.get("ctx") or {}
    if "param" in ctx:  # raised by our validators (protocol.request_error): complete as it is
        named = ctx["param"]  # a part's field: the path to it
        if named and param and param.endswith("." + named):
            named = param
        return bad_request(str(err.get("msg")), param=named, code=err.get("type"))
    if not loc:
        return _body_error(err, content_type)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    if err.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request parameter: '{param}'. The server does not "
                           "implement it, so it refuses the request rather than ignore it.",
                           param=param, code="unknown_parameter")
    given = err.get("input")
    if isinstance(given, (bool, int, float, str)) and len(repr(given)) <= 40:
        msg = f"{msg}, got {json.dumps(given, ensure_ascii=False)}"
    if param:
        msg = f"Invalid value for '{param}': {msg}"
    return bad_request(msg + ".", param=param, code="invalid_value")


def _json_error(err: dict, body: Any) -> APIError:
    """Where the JSON breaks, as json.loads reports it, in line and column terms."""
    reason = (err.get("ctx") or {}).get("error", "invalid JSON")
    where = ""
    loc = err.get("loc", ())
    if isinstance(body, str) and len(loc) > 1 and isinstance(loc[1], int):
        pos = loc[1]
        line = body.count("\n", 0, pos) + 1
        column = pos - (body.rfind("\n", 0, pos) + 1) + 1
        where = f" at line {line}, column {column} (character {pos})"
    return bad_request(f"The request body is not valid JSON: {reason}{where}.",
                       code="invalid_json")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def _body_error(err: dict, content_type: str) -> APIError:
    """The body as a whole is wrong: not JSON at all, empty, or JSON but not an object."""
    if content_type and not _is_json(content_type):
        return APIError(f"Unsupported Content-Type '{content_type}': send the request as JSON "
                        "with 'Content-Type: application/json'.", 400, INVALID_REQUEST,
                        code="invalid_content_type")
    if err.get("type") == "missing":
        return bad_request("The request body is empty: send a JSON object with the request's "
                           "parameters.", code="missing_body")
    kind = _JSON_KINDS.get(type(err.get("input")), "a non-object value")
    return bad_request(f"The request body must be a JSON object, not {kind}.",
                       code="invalid_body")


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null", bytes: "raw bytes"}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_name(part: str) -> bool:
    """Pydantic appends the tried union member ("str", "list[int]") to the location."""
    return part in _TYPE_TAGS or "[" in part or part.startswith("function-")


def _decode_error(exc: StarletteHTTPException) -> APIError | None:
    """FastAPI's "There was an error parsing the body" when the cause is bytes that are not
    UTF-8: say so, and where."""
    cause = exc.__cause__
    if not isinstance(cause, UnicodeDecodeError):
        return None
    byte = cause.object[cause.start:cause.start + 1].hex()
    return bad_request(f"The request body is not valid UTF-8 (byte 0x{byte} at position "
                       f"{cause.start}): send JSON encoded as UTF-8.", code="invalid_encoding")


class UTF8Body:
    """400 for a body in UTF-16 or UTF-32, before the app reads it: such a body begins with a
    byte-order mark or has a zero byte among its first four (JSON text in UTF-8 never does).
    Only those first bytes are read here; the app then gets the body as it came."""

    def __init__(self, app: ASGIApp, routes: FastAPI) -> None:
        self.app = app
        self.routes = routes  # the app whose POST routes read a body (known once it serves)
        self._post_paths: frozenset[str] | None = None

    def post_paths(self) -> frozenset[str]:
        if self._post_paths is None:
            self._post_paths = frozenset(route.path for route in self.routes.routes
                                         if "POST" in getattr(route, "methods", ()))
        return self._post_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # only POST routes read a body; any other request gets the router's answer (405)
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in self.post_paths()):
            await self.app(scope, receive, send)
            return
        messages, head = [], b""
        while len(head) < 4:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            head += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if head.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in head[:4]:
            error = bad_request("The request body is not UTF-8 (it looks like UTF-16 or "
                                "UTF-32): send JSON encoded as UTF-8.", code="invalid_encoding")
            response = error.response()
            response.headers["Connection"] = "close"  # the rest of the body stays unread
            await response(scope, receive, send)
            return
        pending = messages

        async def replayed() -> Message:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replayed, send)


def _openapi_with_errors(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with each 422 ("Validation Error") declared as the 400 the
    handlers send instead, in OpenAI's error shape."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error_schema = {"$ref": "#/components/schemas/ErrorResponse"}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {"description": "Invalid request",
                                        "content": {"application/json":
                                                    {"schema": error_schema}}}
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components.update(ErrorResponse.model_json_schema(
            ref_template="#/components/schemas/{model}").pop("$defs", {}))
        components["ErrorResponse"] = ErrorResponse.model_json_schema(
            ref_template="#/components/schemas/{model}")
        components["ErrorResponse"].pop("$defs", None)
        app.openapi_schema = schema
    return app.openapi_schema


def install_error_handlers(app: FastAPI) -> None:
    """Every failure in OpenAI's error shape (the handlers below), UTF-8 bodies only
    (`UTF8Body`), and an OpenAPI document that declares the 400s the server sends."""
    app.add_middleware(UTF8Body, routes=app)
    app.openapi = lambda: _openapi_with_errors(app)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        decode_error = _decode_error(exc)
        if decode_error is not None:
            return decode_error.response()
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return APIError(message, exc.status_code, kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        message = f"Internal server error: {type(exc).__name__}"
        return APIError(message, 500, SERVER_ERROR).response()
