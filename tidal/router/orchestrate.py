"""Moving a worker between the prefill, decode and null pools (`POST /admin/set_worker_role`).

The worker leaves its pool first (no new requests reach it), is asked to drain and
switch, and joins the new pool only after it reports the new mode with a larger epoch.
On any failure it returns to its old pool unchanged. A decode worker moving to prefill or
null, and a null worker moving to prefill, drain nothing: they hand what they hold over
(tidal/roles/handover.py) and finish it while they serve the new pool (unless
`--planner-decode-move drain`).

A move by hand is refused (409) when the layout it leads to could route nothing where the one
the router heads for could, or when the worker is handing over and the move is to a third role
(it would wait out of every pool until the handover ends), unless the body says `"force": true`; it starts the planner's
cooldowns as the planner's own moves do, so the planner does not undo it at its next round.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import msgspec
from fastapi import FastAPI, Request, Response

from tidal.planner.decide import handing_over
from tidal.planner.loop import worker_load
from tidal.router.workers import DECODE, MODES, NULL, PREFILL, Worker

logger = logging.getLogger(__name__)


def _json(obj: Any, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status_code, media_type="application/json")


def _error(message: str, status_code: int, **extra: Any) -> tuple[int, dict]:
    return status_code, {"error": {"message": message, "code": status_code}, **extra}


def _worker_message(body: Any, status: int) -> str:
    """The text of a worker's error answer (`{"message": ...}` or `{"error": {"message": ...}}`)."""
    body = body if isinstance(body, dict) else {}
    err = body.get("error")
    return body.get("message") or (err.get("message") if isinstance(err, dict) else err) or f"HTTP {status}"


class RoleMover:
    def __init__(self, st: Any):
        self.st = st

    async def hand_move(self, url: str, mode: str, force: bool) -> Response:
        """A move asked for through the API: checked against the layout it leads to, known to the planner."""
        w: Worker = self.st.registry.get(url)
        refusal = self._refusal(w, url, mode) or (None if force else self._no_route_after(w, mode))
        if refusal is None and not force:
            refusal = await self._handing_over(w, mode)
            # checked again after that wait: a move of the worker may have started meanwhile (two asked at once)
            refusal = refusal or self._refusal(self.st.registry.get(url), url, mode) or self._no_route_after(w, mode)
        if refusal is not None:
            logger.info("a move by hand of %s to %s refused (%d): %s", url, mode, refusal[0],
                        refusal[1]["error"]["message"])
            return _json(refusal[1], refusal[0])
        # to its own mode no move: the worker is asked (it says so, or mends a mode set behind the router's back)
        moving = mode != w.mode
        if moving:
            self.st.planner.hand_move_started(url, w.mode, mode, force)
        status, body = 0, {}
        try:
            status, body = await self.move_result(url, mode)
        finally:  # also when cancelled: a move left in flight would hold the planner's moves back for good
            if moving:
                self.st.planner.hand_move_finished(url, status, body)
        return _json(body, status)

    def _refusal(self, w: Worker, url: str, mode: str) -> "tuple[int, dict] | None":
        if w is None:
            return _error(f"unknown worker {url}", 404)
        if mode not in MODES:
            return _error(f"invalid mode {mode!r}; choose from {list(MODES)}", 400)
        if w.switching:
            return _error(f"worker {url} is already being moved", 409)
        return None

    def _no_route_after(self, w: Worker, mode: str) -> "tuple[int, dict] | None":
        """409 when moving `w` to `mode` leaves a layout that can route nothing, where the layout the
        router heads for (every move in flight landed) can."""
        heading = self.st.planner.heading_layout()
        after = dict(heading)
        if w.healthy and not w.switching:
            after[w.mode] -= 1
            after[mode] += 1
        enforce = self.st.cfg.enforce_disaggregation
        if mode == w.mode or not routable(heading, enforce) or routable(after, enforce):
            return None
        layout = ", ".join(f"{n} {m}" for m, n in after.items())
        return _error(f"moving {w.url} to {mode} would leave {layout}: no worker could serve a request; "
                      f"send \"force\": true to move it anyway", 409)

    async def _handing_over(self, w: Worker, mode: str) -> "tuple[int, dict] | None":
        """409 when `w` still finishes another role's requests (a handover, as its load says now) and `mode` is a
        third role: the switch would wait for them with the worker out of every pool."""
        if mode == w.mode:
            return None
        await self.st.checker.refresh_load(w)
        load = worker_load(w)
        if not handing_over(load, mode):  # the planner's rule
            return None
        origin = load.handing_over_from
        return _error(f"worker {w.url} is handing over: it serves as {w.mode} while it finishes its {origin} "
                      f"requests. Until they end it can move back to {origin} at once, but a move to {mode} would "
                      f"wait for them out of every pool; try again later, or send \"force\": true to move it anyway",
                      409)

    async def move_result(self, url: str, mode: str) -> tuple[int, dict]:
        """(HTTP status, JSON body): 200 and the new mode, or an error with the worker left where it was."""
        w: Worker = self.st.registry.get(url)
        refusal = self._refusal(w, url, mode)
        if refusal is not None:
            return refusal
        old_mode, old_epoch = w.mode, w.epoch
        w.switching = True
        try:
            status, body = await self._switch(w, mode)
            if status != 200:
                return _error(f"worker {url} did not switch to {mode}: {_worker_message(body, status)}",
                              # the worker refusing the router's key is not the caller's auth failing
                              502 if status in (0, 401, 403) else status, worker_response=body)
            said = body if isinstance(body, dict) else {}
            epoch = said.get("epoch")
            if said.get("current_mode") != mode or (old_epoch is not None and mode != old_mode
                                                    and not (isinstance(epoch, int) and epoch > old_epoch)):
                return _error(f"worker {url} reported mode {said.get('current_mode')} epoch {epoch}; "
                              f"expected {mode} with an epoch above {old_epoch}", 502, worker_response=body)
            await self._learn(w, mode, epoch)
            if mode != old_mode:
                logger.info("moved worker %s: %s -> %s (epoch %s)", url, old_mode, mode, epoch)
            return 200, {"url": w.url, "old_mode": old_mode, "mode": w.mode, "epoch": w.epoch,
                         "timings_ms": said.get("timings_ms", {}), "message": str(said.get("message") or "")}
        finally:
            w.switching = False

    def _payload(self, w: Worker, mode: str) -> dict:
        """The worker's switch: handover (a decode, or null to prefill, worker serves its new pool at once and
        finishes its requests there), drain (it waits for them), or migrate (it waits migrate_after_s, then moves
        what still runs to the other decode workers: tidal/roles/migration.py; without any, it waits)."""
        planner = self.st.cfg.planner
        timeout_s, move = self.st.cfg.switch_timeout_s, planner.decode_move
        payload = {"mode": mode, "drain": True, "timeout_s": timeout_s, "handover": move == "handover"}
        others = [d.url for d in self.st.registry.pool(DECODE) if d is not w and not d.switching]
        if move == "migrate" and others and w.mode in (DECODE, NULL):
            drain_s = min(planner.migrate_after_s, timeout_s / 2)
            payload.update(drain_policy="migrate", timeout_s=drain_s, migrate_to=others,
                           migrate_timeout_s=timeout_s - drain_s)
        return payload

    async def _switch(self, w: Worker, mode: str) -> tuple[int, Any]:
        timeout_s = self.st.cfg.switch_timeout_s
        payload = self._payload(w, mode)
        try:
            async with self.st.session.post(w.url + "/admin/switch_disaggregation_mode", json=payload,
                                            headers=self.st.worker_admin_headers(),
                                            timeout=aiohttp.ClientTimeout(total=timeout_s + 30)) as r:
                raw = await r.read()
                return r.status, (msgspec.json.decode(raw) if raw else None)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as e:
            return 0, {"message": f"{type(e).__name__}: {e}"}

    async def _learn(self, w: Worker, mode: str, epoch: Any) -> None:
        bport = None
        if mode == PREFILL:
            try:
                async with self.st.session.get(w.url + "/server_info", headers=self.st.worker_headers(),
                                               timeout=aiohttp.ClientTimeout(total=10)) as r:
                    info = await r.json(content_type=None)
                bport = info.get("disaggregation_bootstrap_port")
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
        self.st.registry.set_mode(w.url, mode, epoch if isinstance(epoch, int) else None,
                                  bport if isinstance(bport, int) else None)
        w.reports_epoch = isinstance(epoch, int)


def routable(layout: dict[str, int], enforce_disaggregation: bool) -> bool:
    """The router can send a request somewhere (as `WorkerRegistry.has_usable_path`, on counts): a prefill
    and a decode worker, or, unless disaggregation is enforced, a null or a decode worker (which prefills
    locally)."""
    if layout[PREFILL] and layout[DECODE]:
        return True
    return not enforce_disaggregation and bool(layout[NULL] or layout[DECODE])


class SetRoleBody(msgspec.Struct, forbid_unknown_fields=True):
    # a field it does not know is refused: the worker's own switch takes drain and timeout_s, this one does not
    url: str
    mode: str
    force: bool = False


def add_orchestration_routes(app: FastAPI) -> None:
    @app.post("/admin/set_worker_role")
    async def set_worker_role(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=SetRoleBody)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            status, err = _error(f"body must be {{\"url\": ..., \"mode\": ..., \"force\": false}}: {e}", 400)
            return _json(err, status)
        return await request.app.state.router.mover.hand_move(body.url.strip().rstrip("/"), body.mode, body.force)
