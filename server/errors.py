"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, and reading a JSON request body.

Reading is split in two: `read_body` (on the event loop: bytes off the socket, bounded in size and time) and
`parse_json` (in a worker thread: decoding, which for a large body takes long enough to stall other requests).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

import pydantic
from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}

M = TypeVar("M", bound=pydantic.BaseModel)


class APIError(Exception):
    """Raised anywhere in a handler; the error middleware turns it into an OpenAI error response."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "APIError")
        self.headers = headers  # e.g. Retry-After on a 503
        self.close = close  # close the connection after answering (a request body left half-read)

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


async def read_body(request: web.Request, max_bytes: int, timeout: float | None) -> bytes:
    """The request body: an APIError for a non-JSON content type (400), a body past `max_bytes` (413), or one
    that does not arrive within `timeout` seconds of its headers (408, and the connection is closed)."""
    ctype = request.content_type
    if request.headers.get("Content-Type") is not None and not (_is_json_type(ctype) or ctype == _GENERIC):
        raise APIError(f"Unsupported Content-Type '{request.content_type}'; send the body as application/json.", 400)
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(
            f"Request body of {request.content_length} bytes exceeds the limit of {max_bytes} bytes.", 413, close=True
        )
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise APIError(
            f"The request body did not arrive within {timeout:g} s (--timeout-request-body).", 408, close=True
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(f"Request body exceeds the limit of {max_bytes} bytes.", 413, close=True) from None
    except web.RequestPayloadError:  # a broken chunked encoding, a body shorter than its Content-Length
        raise APIError("The request body is malformed (incomplete or badly chunked).", 400, close=True) from None
    if not raw:
        raise APIError("The request body is empty; expected a JSON object.", 400)
    return raw


def parse_json(raw: bytes) -> dict:
    """`raw` as a JSON object (UTF-8, no NaN/Infinity, no lone surrogates), or a 400."""
    try:
        text = raw.decode("utf-8")
        data = json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise APIError(f"Invalid JSON in request body: it is not UTF-8 ({e.reason} at byte {e.start}).", 400) from None
    except json.JSONDecodeError as e:
        raise APIError(f"Invalid JSON in request body: {e}", 400) from None
    except RecursionError:
        raise APIError("Invalid JSON in request body: nested too deeply.", 400) from None
    if not isinstance(data, dict):
        raise APIError(f"The request body must be a JSON object, got {type(data).__name__}.", 400)
    if _SURROGATE_ESCAPE.search(text):  # rare: only then walk the whole body
        _reject_lone_surrogates(data, [])
    return data


# "\ud800" in JSON text decodes to a lone surrogate (a valid pair decodes to one character): no tokenizer,
# template or encoder accepts it, so it is a 400 naming where it is, not a 500 from deep inside.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_lone_surrogates(value: Any, path: list) -> None:
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        if m:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "body"
            raise APIError(
                f"Invalid text in `{where}`: it contains a lone surrogate ({ascii(m.group())}), which "
                "is not a Unicode character.",
                400,
                param=str(path[0]) if path else None,
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            _reject_lone_surrogates(k, path + [k])
            _reject_lone_surrogates(v, path + [k])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _reject_lone_surrogates(v, path + [i])


def _reject_constant(name: str):
    # Python's json reads NaN / Infinity, which JSON does not have; a NaN logit bias or penalty would pass
    # every range check (comparisons with NaN are false).
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


_SLICE = 1000  # list items validated per call when a list is long


def parse_model(cls: type[M], data: dict, *, sliced: tuple[str, ...] = ()) -> M:
    """Validates a request; pydantic's errors become one 400 message naming each bad field.

    `sliced`: list fields validated a slice at a time when long. One pydantic call holds the GIL throughout,
    so validating 300k messages at once would stall the event loop (and every stream) for a second."""
    long = [name for name in sliced if isinstance(data.get(name), list) and len(data[name]) > _SLICE]
    try:
        if not long:
            return cls.model_validate(data)
        req = cls.model_validate({**data, **{name: [] for name in long}})
        for name in long:
            setattr(req, name, _validate_sliced(cls, name, data[name]))
        return req
    except pydantic.ValidationError as e:
        raise APIError(format_validation_error(e), 400, param=_first_param(e)) from None


_ADAPTERS: dict[tuple[type, str], pydantic.TypeAdapter] = {}


def _validate_sliced(cls: type[pydantic.BaseModel], name: str, items: list) -> list:
    adapter = _ADAPTERS.get((cls, name))
    if adapter is None:
        adapter = _ADAPTERS[(cls, name)] = pydantic.TypeAdapter(cls.model_fields[name].annotation)
    out: list = []
    for start in range(0, len(items), _SLICE):
        try:
            out.extend(adapter.validate_python(items[start : start + _SLICE]))
        except pydantic.ValidationError as e:  # locations as if the whole request had been validated at once
            errors = [
                {
                    "type": err["type"],
                    "input": err["input"],
                    "ctx": err.get("ctx", {}),
                    "loc": (name, err["loc"][0] + start, *err["loc"][1:]),
                }
                for err in e.errors(include_url=False)
            ]
            raise pydantic.ValidationError.from_exception_data(cls.__name__, errors) from None
    return out


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
