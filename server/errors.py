"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, and reading a JSON request body."""

from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}

M = TypeVar("M", bound=pydantic.BaseModel)


class APIError(Exception):
    """Raised anywhere in a handler; the error middleware turns it into an OpenAI error response."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "APIError")

    def body(self) -> dict:
        return error_body(self.message, self.status, param=self.param, err_type=self.err_type)


def error_body(message: str, status: int, *, param: str | None = None, err_type: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": err_type or _TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def error_response(message: str, status: int, *, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param=param), status=status)


def model_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", 404, param="model")


_GENERIC = "application/octet-stream"


def _is_json_type(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


async def read_json(request: web.Request, max_bytes: int) -> dict:
    """The request body as a JSON object, or an APIError (400 bad JSON/content type, 413 too big).

    A missing or generic (application/octet-stream) Content-Type is read as JSON; any other must be JSON.
    """
    ctype = request.content_type
    if request.headers.get("Content-Type") is not None and not (_is_json_type(ctype) or ctype == _GENERIC):
        raise APIError(f"Unsupported Content-Type '{request.content_type}'; send the body as application/json.", 400)
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(f"Request body of {request.content_length} bytes exceeds the limit of {max_bytes} bytes.", 413)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(f"Request body exceeds the limit of {max_bytes} bytes.", 413) from None
    if not raw:
        raise APIError("The request body is empty; expected a JSON object.", 400)
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"Invalid JSON in request body: {e}", 400) from None
    except RecursionError:
        raise APIError("Invalid JSON in request body: nested too deeply.", 400) from None
    if not isinstance(data, dict):
        raise APIError(f"The request body must be a JSON object, got {type(data).__name__}.", 400)
    return data


def _reject_constant(name: str):
    # Python's json reads NaN / Infinity, which JSON does not have; a NaN logit bias or penalty would pass
    # every range check (comparisons with NaN are false).
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


def parse_model(cls: type[M], data: dict) -> M:
    """Validates a request; pydantic's errors become one 400 message naming each bad field."""
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise APIError(format_validation_error(e), 400, param=_first_param(e)) from None


def format_validation_error(e: pydantic.ValidationError) -> str:
    """One clause per bad field; a value that matches none of a union's members gets one clause, not one
    per member."""
    by_field: dict[str, list[dict]] = {}
    for err in e.errors(include_url=False):
        loc = [str(x) for x in err["loc"] if not _is_union_tag(x)]
        by_field.setdefault(loc[0] if loc else "body", []).append({**err, "path": ".".join(loc) or "body"})
    parts = []
    for name, errs in by_field.items():
        if len({x["path"] for x in errs}) > 1 or len(errs) > 1 and errs[0]["type"] != "missing":
            union_input = errs[0]["input"] if errs[0]["path"] == name else None
            shown = f" (got {_short(union_input)})" if union_input is not None else ""
            parts.append(f"{name}: Input does not match any accepted type{shown}")
            continue
        err = errs[0]
        value = "" if err["type"] == "missing" else f" (got {_short(err.get('input'))})"
        parts.append(f"{err['path']}: {err['msg']}{value}")
    n = len(parts)
    head = f"{n} validation error{'s' if n != 1 else ''} in request"
    if n > 6:
        parts = parts[:6] + [f"... and {n - 6} more"]
    return head + ": " + "; ".join(parts)


def _is_union_tag(x) -> bool:
    # pydantic names the union member it tried ("str", "list[int]", "function-after[...]") in the location.
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict", "list"))


def _first_param(e: pydantic.ValidationError) -> str | None:
    errors = e.errors(include_url=False)
    return str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
