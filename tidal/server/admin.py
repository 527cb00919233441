"""Admin API: runtime role switching (`/admin/*`, SGLang's `/pd_role_switch`).

Authentication is tidal/server/auth.py's: these are admin routes (the admin key if set, else
the API key if set).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import msgspec
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict

from tidal.server.protocol import ApiError, JSONResp, error_body, parse_body


DRAIN_POLICIES = ("reject", "wait", "migrate")


class SwitchBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    mode: str
    drain: bool = False
    timeout_s: float = 30.0
    flush_cache: bool = True
    handover: bool = False
    # reject: 503 unless idle (drain false); wait: drain up to timeout_s (drain true); migrate: drain, then move
    # the running requests to the decode servers in migrate_to (their base URLs) for up to migrate_timeout_s
    drain_policy: Optional[str] = None
    migrate_to: list[str] = []
    migrate_timeout_s: float = 30.0

    def policy(self) -> str:
        """The drain policy, checked against the fields that say it too (ApiError 400)."""
        if self.drain_policy is None:
            if self.migrate_to:
                raise ApiError("migrate_to needs \"drain_policy\": \"migrate\"")
            return "wait" if self.drain else "reject"
        if self.drain_policy not in DRAIN_POLICIES:
            raise ApiError(f"invalid drain_policy {self.drain_policy!r}; choose from {list(DRAIN_POLICIES)}")
        if self.drain_policy == "migrate":
            if not self.migrate_to:
                raise ApiError("drain_policy migrate needs migrate_to: the base URLs of the decode servers to "
                               "move the running requests to")
            bad = [u for u in self.migrate_to if not u.startswith(("http://", "https://"))]
            if bad:
                raise ApiError(f"migrate_to entries must be http(s) URLs, got {bad[:3]}")
            if not 0 < self.migrate_timeout_s <= 3600:
                raise ApiError(f"migrate_timeout_s must be in (0, 3600], got {self.migrate_timeout_s}")
        elif self.migrate_to:
            raise ApiError(f"migrate_to applies to drain_policy migrate, not {self.drain_policy}")
        return self.drain_policy


class RoleSwitchBody(BaseModel):  # SGLang's /pd_role_switch
    model_config = ConfigDict(extra="ignore", strict=True)
    new_role: str


class PrepareBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    mode: str


def _switch_response(resp: Any) -> Response:
    body = msgspec.to_builtins(resp)
    body.pop("type", None)
    body.pop("call_id", None)
    code = body.pop("status_code")
    if code != 200:
        body["error"] = error_body(body["message"], code)["error"]
    headers = {"Retry-After": "1"} if code == 503 else None
    return JSONResp(body, status_code=code, headers=headers)


async def _switch(request: Request, mode: str, drain: bool, timeout_s: float, flush_cache: bool,
                  handover: bool = False, migrate_to: Sequence[str] = (), migrate_timeout_s: float = 30.0) -> Response:
    if not 0 < timeout_s <= 3600:
        raise ApiError(f"timeout_s must be in (0, 3600], got {timeout_s}")
    tm = request.app.state.ctx.tm
    return _switch_response(await tm.switch_mode(mode, drain, timeout_s, flush_cache, handover,
                                                 migrate_to=migrate_to, migrate_timeout_s=migrate_timeout_s))


def add_admin_api(app: FastAPI) -> None:
    @app.post("/admin/switch_disaggregation_mode")
    async def switch_mode(request: Request) -> Response:
        body = parse_body(SwitchBody, await request.body())
        policy = body.policy()
        return await _switch(request, body.mode, policy != "reject", body.timeout_s, body.flush_cache, body.handover,
                             migrate_to=body.migrate_to if policy == "migrate" else (),
                             migrate_timeout_s=body.migrate_timeout_s)

    @app.post("/pd_role_switch")
    async def pd_role_switch(request: Request) -> Response:
        body = parse_body(RoleSwitchBody, await request.body())
        return await _switch(request, body.new_role, False, 30.0, True)

    @app.post("/admin/prepare_mode")
    async def prepare_mode(request: Request) -> Response:
        body = parse_body(PrepareBody, await request.body())
        return _switch_response(await request.app.state.ctx.tm.prepare_mode(body.mode))

    @app.get("/admin/disaggregation_status")
    async def status(request: Request) -> Response:
        st = await request.app.state.ctx.tm.mode_status()
        body = msgspec.to_builtins(st)
        body.pop("type", None)
        body.pop("call_id", None)
        return JSONResp(body)
