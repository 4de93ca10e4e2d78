"""LoRA adapters on the server, as vLLM serves them: `--lora-modules name=path` or its JSON form
'{"name": ..., "path": ..., "base_model_name": ...}' loaded at start-up, `model: "<adapter name>"` in a request,
adapters listed in /v1/models with their parent, and (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, vLLM's variable)
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from dataclasses import dataclass, field

from aiohttp import web

from jaxllm.lora.request import LoRARequest
from server.errors import APIError, parse_json, read_body

logger = logging.getLogger("jaxllm.server")

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """One --lora-modules value: name=path, or a JSON object with name, path and optionally base_model_name."""
    value = value.strip()
    if value.startswith("{"):
        try:
            d = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {value!r}: {e}") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise argparse.ArgumentTypeError(
                f"--lora-modules: a JSON module needs string 'name' and 'path', got {value!r}."
            )
        unknown = sorted(set(d) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules: unknown keys {unknown} in {value!r}.")
        return LoRAModulePath(d["name"], d["path"], d.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or a JSON object, got {value!r}.")
    return LoRAModulePath(name, path)


def check_lora_modules(modules: list[LoRAModulePath] | None, max_lora_rank: int) -> None:
    """--lora-modules' folders and adapter configs, read before the engine loads the model and compiles (minutes):
    a missing folder or a refused config stops the command at once, naming the module. (Their tensors are
    checked against the model when the server loads them: load_static.)"""
    from jaxllm.lora.peft import check_adapter_config, read_adapter_config

    for m in modules or ():
        try:
            check_adapter_config(read_adapter_config(m.path), m.path, max_lora_rank)
        except ValueError as e:
            raise SystemExit(f"--lora-modules {m.name}={m.path}: {e}") from None


def runtime_updating_allowed(environ) -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true" (any case) turn the routes on."""
    return environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass
class ServedLoRAs:
    """The adapters the server names (what /v1/models lists): name -> LoRARequest; ids from one counter."""

    base_names: list[str]
    requests: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _loading: set[str] = field(default_factory=set)  # names being loaded (two loads of one name: one wins)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.requests.get(name)

    async def load(self, engine, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Registers and loads an adapter in the engine (its refusal: an APIError with the engine's message)."""
        if not name or not path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.", err_type="InvalidUserInput")
        if name in self.requests or name in self._loading:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", err_type="InvalidUserInput")
        if name in self.base_names:
            raise APIError(
                f"'{name}' is the name of the served base model.", err_type="InvalidUserInput", param="lora_name"
            )
        parent = base_model_name if base_model_name in self.base_names else None
        request = LoRARequest(name, next(self._ids), path, base_model_name=parent)
        add = getattr(engine, "add_lora", None)
        if add is None:
            raise APIError("This engine does not serve LoRA adapters (start it with --enable-lora).")
        self._loading.add(name)
        try:
            await add(request)
        except ValueError as e:
            not_found = str(e).startswith("No adapter found")
            raise APIError(str(e), 404 if not_found else 400, param="lora_path") from None
        finally:
            self._loading.discard(name)
        self.requests[name] = request
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return request

    async def unload(self, engine, name: str | None, lora_int_id: int | None = None) -> None:
        if not name and not lora_int_id:
            raise APIError("either 'lora_name' and 'lora_int_id' needs to be provided.", err_type="InvalidUserInput")
        request = (
            self.requests.get(name)
            if name
            else next((r for r in self.requests.values() if r.lora_int_id == lora_int_id), None)
        )
        if request is None:
            raise APIError(f"The lora adapter '{name or lora_int_id}' cannot be found.", 404)
        del self.requests[request.lora_name]
        await engine.remove_lora(request.lora_int_id)
        logger.info("Removed LoRA adapter: name '%s'", request.lora_name)


async def load_static(state, modules: list[LoRAModulePath]) -> None:
    """--lora-modules at start-up: any adapter that does not load stops the server (vLLM's behaviour)."""
    for m in modules:
        try:
            await state.loras.load(state.engine, m.name, m.path, m.base_model_name)
        except APIError as e:
            raise ValueError(f"--lora-modules {m.name}={m.path}: {e.message}") from None


async def _read(request: web.Request):
    """(server state, the JSON body) through the same limits as every route (the body decoded off the loop)."""
    from server.serving_common import STATE

    state = request.app[STATE]
    raw = await read_body(request, state.limits.max_body_bytes, state.limits.timeout_request_body)
    return state, await state.workers.run(parse_json, raw, size=len(raw))


async def load_lora_adapter(request: web.Request) -> web.Response:
    state, body = await _read(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, (str, type(None))) or not isinstance(path, (str, type(None))):
        raise APIError("'lora_name' and 'lora_path' must be strings.", err_type="InvalidUserInput")
    await state.loras.load(state.engine, name, path)
    return web.Response(status=200, text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state, body = await _read(request)
    name, lora_int_id = body.get("lora_name"), body.get("lora_int_id")
    if not isinstance(name, (str, type(None))) or not isinstance(lora_int_id, (int, type(None))):
        raise APIError("'lora_name' must be a string and 'lora_int_id' an integer.", err_type="InvalidUserInput")
    await state.loras.unload(state.engine, name, lora_int_id)
    return web.Response(status=200, text=f"Success: LoRA adapter '{name or lora_int_id}' removed successfully.")
