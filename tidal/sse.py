"""Reading a server-sent event stream (the /generate and OpenAI streams tidal and its peers answer with)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

import aiohttp


async def iter_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[Optional[dict[str, Any]]]:
    """The JSON objects of `data:` lines; None for `data: [DONE]` (then stops)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                yield None
                return
            if payload:
                yield json.loads(payload)
