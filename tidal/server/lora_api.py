"""SGLang's LoRA routes (/load_lora_adapter, /unload_lora_adapter) and the adapters' OpenAI model cards."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI, Request
from starlette.responses import Response

from tidal.server.protocol import ApiError, JSONResp, LoadLoRARequest, UnloadLoRARequest, parse_body


def add_lora_routes(app: FastAPI) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = parse_body(LoadLoRARequest, await request.body())
        resp = await request.app.state.ctx.tm.load_lora(body.lora_name, body.lora_path)
        return _answer(resp)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = parse_body(UnloadLoRARequest, await request.body())
        resp = await request.app.state.ctx.tm.unload_lora(body.lora_name)
        return _answer(resp)


def _answer(resp: Any) -> Response:
    if not resp.success:
        raise ApiError(resp.message, resp.status_code)
    return JSONResp({"success": True, "message": resp.message, "loaded_adapters": resp.adapters})


def adapter_cards(tm: Any, base: dict) -> list[dict]:
    """One OpenAI model card per loaded adapter, its parent the base model (vLLM's shape)."""
    return [{**base, "id": name, "root": path, "parent": base["id"]} for name, path in getattr(tm, "lora_adapters", {}).items()]


def lora_for_model(tm: Any, requested: Optional[str], served: str) -> Optional[str]:
    """The adapter an OpenAI `model` selects: None for the base model (no model, "default" or its
    name), the adapter of that name, else 404 as for any unknown model."""
    if requested is None or requested in (served, "default"):
        return None
    if requested in getattr(tm, "lora_adapters", {}):
        return requested
    raise ApiError(f"The model `{requested}` does not exist; this server serves `{served}`"
                   + (f" and the LoRA adapters {sorted(tm.lora_adapters)}." if getattr(tm, "lora_adapters", None) else "."),
                   404)
