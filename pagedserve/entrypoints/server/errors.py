"""OpenAI-style error bodies for every failure, so clients never see a bare 500 or 422.

OpenAI answers bad input with 400 and `{"error": {"message", "type", "param", "code"}}`;
its SDKs map the status to an exception class and read `message`. FastAPI's own validation
errors (wrong types, out-of-range values, malformed JSON) are converted to the same shape
with status 400, since to a client they are all "invalid request".

Unknown model names get 404 `model_not_found`, as OpenAI returns; everything else a client
can get wrong is 400.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
        return bad_request(f"Malformed JSON body: {err.get('msg', '')}", code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    ctx = err.get("ctx") or {}
    if "param" in ctx:  # raised by our validators (protocol.request_error): complete as it is
        return bad_request(str(err.get("msg")), param=ctx["param"], code=err.get("type"))
    if not loc:
        return _body_error(err, content_type)
    # union members show up as extra location parts (e.g. prompt.str); keep the field path
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    if param:
        msg = f"Invalid value for '{param}': {msg}"
    return bad_request(msg, param=param, code="invalid_value")


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return APIError(message, exc.status_code, kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        message = f"Internal server error: {type(exc).__name__}"
        return APIError(message, 500, SERVER_ERROR).response()
