"""Bearer-key authentication for the server and the router: one ASGI middleware.

Every request path is classified before any handler runs:
  public  exactly one of `Guard.public_paths` (health, metrics): always open.
  admin   the normalized path is one of `admin_paths` or under one of `admin_prefixes`.
  api     everything else.
The classification uses the path normalized the way no router would (percent-decoded
until stable, slashes collapsed, trailing slash dropped, lower case), so a variant such
as `//admin/x`, `/ADMIN/x`, `/flush_cache/` or `/admin%2Fx` is at least as guarded as the
route it might reach: without the right key it answers 401; with it, the app's own 404 or
redirect. Keys are compared with `hmac.compare_digest`.

A request that presented any configured key is marked authenticated
(`request.state.authenticated`); handlers use that to decide what to reveal.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
from typing import Any, Optional
from urllib.parse import unquote

from tidal.server.protocol import JSONResp, error_body

PUBLIC_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
# the server's state-changing routes; everything else there reads or generates
SERVER_ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/pd_role_switch", "/load_lora_adapter",
                                "/unload_lora_adapter"})
ADMIN_PREFIXES = ("/admin",)


def normalize_path(path: str) -> str:
    for _ in range(8):  # %252F -> %2F -> /
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = re.sub(r"/+", "/", "/" + path.strip()).rstrip("/") or "/"
    return path.lower()


@dataclasses.dataclass(frozen=True)
class Guard:
    """Which keys open which class of routes. Empty key tuples mean open, unless
    `admin_refusal` is set: then admin routes answer 401 with that message."""

    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    admin_paths: frozenset = SERVER_ADMIN_PATHS
    admin_prefixes: tuple[str, ...] = ADMIN_PREFIXES
    public_paths: frozenset = PUBLIC_PATHS
    admin_refusal: Optional[str] = None

    @classmethod
    def for_server(cls, api_key: Optional[str], admin_key: Optional[str]) -> "Guard":
        """Admin routes: the admin key if set, else the API key if set, else open.
        API routes: the API key if set (the admin key opens them too), else open."""
        admin = (admin_key,) if admin_key else ((api_key,) if api_key else ())
        api = tuple(k for k in (api_key, admin_key) if k) if api_key else ()
        return cls(api_keys=api, admin_keys=admin)

    def route_class(self, path: str) -> str:
        if path in self.public_paths:
            return "public"
        p = normalize_path(path)
        if p in self.admin_paths or any(p == x or p.startswith(x + "/") for x in self.admin_prefixes):
            return "admin"
        return "api"

    def all_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.api_keys + self.admin_keys))


def bearer_token(headers: Any) -> Optional[bytes]:
    """The token of an `Authorization: Bearer TOKEN` header (raw ASGI header list), or None."""
    for name, value in headers or ():
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def key_matches(token: Optional[bytes], keys: tuple[str, ...]) -> bool:
    if token is None:
        return False
    found = False
    for key in keys:  # no early exit: the time does not say which key matched
        found |= hmac.compare_digest(token, key.encode())
    return found


def _refuse(message: str) -> JSONResp:
    return JSONResp(error_body(message, 401), status_code=401, headers={"WWW-Authenticate": "Bearer"})


class AuthMiddleware:
    def __init__(self, app: Any, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        g = self.guard
        token = bearer_token(scope.get("headers"))
        authenticated = key_matches(token, g.all_keys())
        scope.setdefault("state", {})["authenticated"] = authenticated
        kind = g.route_class(scope["path"])
        if kind == "admin" and not g.admin_keys and g.admin_refusal:
            return await _refuse(g.admin_refusal)(scope, receive, send)
        keys = g.admin_keys if kind == "admin" else g.api_keys if kind == "api" else ()
        if keys and not key_matches(token, keys):
            what = "admin" if kind == "admin" else "API"
            return await _refuse(f"Invalid or missing {what} key: send Authorization: Bearer <key>")(
                scope, receive, send)
        return await self.app(scope, receive, send)


def is_authenticated(request: Any) -> bool:
    return bool(getattr(request.state, "authenticated", False))
