"""ModeController: switches the scheduler's role at runtime, with drain, epochs and rollback.

States: IDLE -> CHECKING -> (DRAINING) -> SWITCHING -> IDLE, and SWITCHING -> ROLLBACK -> IDLE;
a handover (decode -> prefill or null, null -> prefill, `handover: true`): SWITCHING -> HANDOVER ->
IDLE, the new role serving from HANDOVER on while the old role finishes what it held
(roles/handover.py). A switch back to the old role during a handover waits for the new role's own
requests only (HANDOVER -> (DRAINING) -> SWITCHING -> IDLE): the old role never stopped, and takes the
server back with what it still holds; one that fails or times out leaves the handover as it was.
A switch runs inside the scheduler loop between iterations, never beside a forward pass.
Nothing of the old role is released until the new one is committed, so a failure at any
step restores the snapshot exactly: the old role keeps serving, its bootstrap server and
its prefix cache untouched.

With tensor parallelism every rank runs the same switch in the same loop iteration and
the ranks agree after every step: a step that failed on any rank rolls every rank back,
and the switch commits only once every rank completed every step.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from tidal.config import DISAGG_MODES, HANDOVER_SWITCHES
from tidal.messages import ModeStatusResp, PrepareModeReq, SwitchModeReq, SwitchModeResp
from tidal.roles.handover import HandoverRole
from tidal.roles.ranks import FaultInjector, SwitchFailed, agree, any_rank

if TYPE_CHECKING:
    from tidal.roles.loop import ControllerLoop

logger = logging.getLogger(__name__)

class TransitionState(str, enum.Enum):
    IDLE = "IDLE"
    CHECKING = "CHECKING"
    DRAINING = "DRAINING"
    SWITCHING = "SWITCHING"
    ROLLBACK = "ROLLBACK"
    HANDOVER = "HANDOVER"  # switched; the old role still finishes what it held


@dataclass
class PendingSwitch:
    msg: SwitchModeReq
    drain_started: float = 0.0
    timings_ms: dict = field(default_factory=dict)
    handover: bool = False  # the old role's requests go on under the new role instead of being drained
    reversal: bool = False  # back to the role a handover replaced, which still holds its requests
    migrating: bool = False  # drain_policy migrate, past the drain timeout: running requests move elsewhere
    migrated_before: int = 0  # the migrator's count of requests it moved, when this switch began migrating


class ModeController:
    def __init__(self, sched: ControllerLoop):
        self.s = sched
        self.enabled = sched.args.enable_dynamic_disaggregation
        self.keep_components = sched.args.keep_role_components
        self.state = TransitionState.IDLE
        self.epoch = 0
        self.target: Optional[str] = None
        self.last_error: Optional[str] = None
        self.last_timings_ms: dict = {}
        self.idle_roles: dict[str, Any] = {}  # initialized but inactive (pre-warmed or kept)
        self.pending: Optional[PendingSwitch] = None
        self.queued: Optional[PendingSwitch] = None  # a drained switch asked for during a handover
        self.handover_started = 0.0
        self.tp = sched.tp
        self.faults = FaultInjector.from_env(self.tp.rank, self.tp.size)

    @property
    def admitting(self) -> bool:
        return self.state != TransitionState.DRAINING

    # ------------------------------------------------------------------ requests

    @property
    def handing_over_from(self) -> str:
        """The role whose requests a handover still finishes ("" when none)."""
        return self.s.role.old.name if isinstance(self.s.role, HandoverRole) else ""

    def on_switch(self, msg: SwitchModeReq) -> Optional[SwitchModeResp]:
        """Start a switch; the reply now, or None when it comes later (after a drain, or a handover first)."""
        invalid = self._invalid(msg.mode)
        if invalid is not None:
            return self._reply(msg, *invalid)
        if self.state == TransitionState.HANDOVER and msg.mode == self.s.role.name:
            return self._reply(msg, 200, f"already in {msg.mode} mode (the {self.s.role.old.name} role still "
                                         f"finishing its requests: handover)")
        if self.state == TransitionState.HANDOVER and self.queued is None and msg.mode == self.s.role.old.name:
            return self._begin_reversal(msg)
        if self.state == TransitionState.HANDOVER and msg.drain and self.queued is None:
            self.queued = PendingSwitch(msg, drain_started=time.monotonic())
            logger.info("a switch to %s waits for the handover to end (timeout %.1fs)", msg.mode, msg.timeout_s)
            return None
        busy = self._busy()
        if busy is not None:
            return self._reply(msg, *busy)
        return self._begin(msg, None)

    def _begin(self, msg: SwitchModeReq, drain_started: Optional[float]) -> Optional[SwitchModeResp]:
        """The switch from an idle controller; its drain timeout counts from `drain_started` if given."""
        if msg.mode == self.s.role.name:
            return self._reply(msg, 200, f"already in {msg.mode} mode")
        self.state, self.target = TransitionState.CHECKING, msg.mode
        pending = PendingSwitch(msg, drain_started=drain_started or time.monotonic())
        pending.handover = msg.handover and (self.s.role.name, msg.mode) in HANDOVER_SWITCHES
        if not self._ready(pending):
            if not msg.drain:
                self._to_idle()
                why = f"queues not empty: {self.queue_sizes()}; retry or use drain"
                if msg.handover and not pending.handover:
                    pairs = ", ".join(f"{a} -> {b}" for a, b in HANDOVER_SWITCHES)
                    why += f" (a handover applies to {pairs} only)"
                return self._reply(msg, 503, why)
            self.state, self.pending = TransitionState.DRAINING, pending
            logger.info("draining for a switch to %s (timeout %.1fs)", msg.mode, msg.timeout_s)
            return None
        if drain_started is not None:
            pending.timings_ms["drain"] = round((time.monotonic() - drain_started) * 1000, 3)
        return self._switch(pending)

    def _begin_reversal(self, msg: SwitchModeReq) -> Optional[SwitchModeResp]:
        """Back to the role a handover replaced: at once where the new role holds no request of its own,
        else after draining those (with drain), else 503."""
        self.target = msg.mode
        pending = PendingSwitch(msg, drain_started=time.monotonic(), reversal=True)
        if self._reversible():
            return self._reverse(pending)
        if not msg.drain:
            self.target = None
            return self._reply(msg, 503, f"the {self.s.role.name} role holds requests of its own "
                                         f"({self._own_work()}); retry or use drain")
        self.state, self.pending = TransitionState.DRAINING, pending
        logger.info("draining the %s role's own requests to switch back to %s (timeout %.1fs)", self.s.role.name,
                    msg.mode, msg.timeout_s)
        return None

    def _own_work(self) -> str:
        """What the new role of a handover holds of its own, for messages."""
        s, new = self.s, self.s.role.new
        prompts = sum(r.pd is not None for r in self._prompts())
        locked = s.tree_cache.protected_size() if s.role.replaced_cache else 0
        parts = [f"{k} {v}" for k, v in new.queue_sizes().items() if v]
        parts += [f"{prompts} PD prompts to prefill"] if prompts else []
        parts += [f"{locked} prefix-cache tokens in use"] if locked else []
        return ", ".join(parts) or "a pass in flight"

    def _prompts(self) -> list:
        chunked = self.s.chunked_req
        return self.s.waiting_queue + ([chunked] if chunked is not None else [])

    def _reversible(self) -> bool:
        """The new role of a handover holds nothing the old one cannot take back: its own queues are empty,
        no prompt waits to be prefilled for a decode partner, and where the handover replaced the prefix cache
        (a decode role that shared none) no request holds a prefix in it and no chunked prefill is midway: every
        request then owns all its KV, as when the handover began."""
        s, role = self.s, self.s.role
        if s.inflight is not None or not role.new.is_idle() or any(r.pd is not None for r in self._prompts()):
            return False
        return not role.replaced_cache or (s.chunked_req is None and s.tree_cache.protected_size() == 0)

    def _ready(self, p: PendingSwitch) -> bool:
        """Nothing left that the switch must wait for: every request gone, or for a handover that replaces
        the prefix cache a chunked prefill (its prefix moves to the new prefix cache only once whole)."""
        if p.handover:
            return self.s.chunked_req is None or self._keeps_cache(p.msg.mode)
        return self.s.is_idle()

    def _wants_radix(self, mode: str) -> bool:
        """Whether the role `mode` shares prefixes (decode never does)."""
        return mode != "decode" and not self.s.args.disable_radix_cache

    def _keeps_cache(self, mode: str) -> bool:
        """The role `mode` uses the prefix cache there is (null <-> prefill)."""
        return self._wants_radix(mode) == (not getattr(self.s.tree_cache, "disable", False))

    def _invalid(self, mode: str) -> Optional[tuple[int, str]]:
        if not self.enabled:
            return 400, "dynamic disaggregation is disabled; start the server with --enable-dynamic-disaggregation"
        if mode not in DISAGG_MODES:
            return 400, f"invalid mode {mode!r}; choose from {list(DISAGG_MODES)}"
        return None

    def _busy(self) -> Optional[tuple[int, str]]:
        if self.state == TransitionState.HANDOVER:
            queued = f"; a switch to {self.queued.msg.mode} already waits for it" if self.queued else \
                f"; retry when it is done, or ask with drain to wait for it (a switch back to {self.s.role.old.name} " \
                f"waits for none)"
            return 409, (f"the {self.s.role.old.name} role is still finishing the requests it held when this server "
                         f"switched to {self.s.role.name} (handover){queued}")
        if self.state != TransitionState.IDLE:
            return 409, f"a switch to {self.target} is in progress ({self.state.value})"
        return None

    def on_prepare(self, msg: PrepareModeReq) -> SwitchModeResp:
        """Initialize a role's components now so a later switch to it is fast."""
        refusal = self._invalid(msg.mode) or self._busy()
        if refusal is not None:
            return self._reply(msg, *refusal)
        if msg.mode != self.s.role.name and msg.mode not in self.idle_roles:
            role, error = None, None
            try:
                role = self._build_role(msg.mode, activate=False)
            except Exception as e:
                error = e
            failure = agree(self.tp, "prepare", error)
            if failure is not None:
                if role is not None:
                    role.shutdown()
                return self._reply(msg, 500, f"preparing {msg.mode} failed{failure[0]}")
            self.idle_roles[msg.mode] = role
        return self._reply(msg, 200, f"{msg.mode} prepared")

    def on_iteration(self) -> None:
        """Called once per loop iteration: finish draining, or time out and roll back; end a handover
        once the old role holds nothing."""
        if self.state == TransitionState.HANDOVER:
            self._during_handover()
            return
        p = self.pending
        if self.state != TransitionState.DRAINING or p is None:
            return
        if p.reversal:
            self._draining_for_reversal(p)
            return
        waited = time.monotonic() - p.drain_started
        deadline = p.msg.timeout_s + (p.msg.migrate_timeout_s if p.msg.migrate else 0.0)
        if self._ready(p):
            self.pending = None
            p.timings_ms.setdefault("drain", round(waited * 1000, 3))
            if p.migrating:
                p.timings_ms["migrate"] = round((waited - p.msg.timeout_s) * 1000, 3)
            self.s.drain()  # a handover waits for no pass; the one in flight is processed first
            self.s.replies.append(self._with_migrations(p, self._switch(p)))
        elif any_rank(self.tp, waited > deadline):  # clocks differ: all ranks time out together
            self.pending = None
            self._to_idle()
            self.last_error = f"drain timed out after {p.msg.timeout_s}s"
            if p.migrating:
                self.last_error += f" and the migration after {p.msg.migrate_timeout_s}s ({self._unmigrated()})"
            self.s.replies.append(self._with_migrations(p, self._reply(
                p.msg, 504, f"{self.last_error}; rolled back, still serving as {self.s.role.name}")))
        elif p.msg.migrate and any_rank(self.tp, waited > p.msg.timeout_s):
            self._migrate(p)

    def _migrate(self, p: PendingSwitch) -> None:
        """Past the drain timeout with drain_policy migrate: every running request that can go moves to another
        decode server (tidal/roles/migration.py); what cannot stays, and the drain goes on for it."""
        s = self.s
        if not p.migrating:
            p.migrating = True
            p.timings_ms["drain"] = round(p.msg.timeout_s * 1000, 3)
            s.migrator.forget_refusals()
            p.migrated_before = s.migrator.migrated
            logger.info("drain timed out after %.1fs: migrating the running requests", p.msg.timeout_s)
        s.drain()  # no pass in flight may hold a request that leaves
        s.migrator.offer_running()

    def _unmigrated(self) -> str:
        """What kept the migration from ending, for messages."""
        from tidal.roles.migration import why_not_migratable

        s = self.s
        stay = [f"{r.rid}: {why_not_migratable(r) or 'its migration failed'}" for r in s.running]
        parts = [f"{len(s.migrator.moving)} still moving"] if s.migrator.moving else []
        parts += [f"{len(stay)} stayed ({'; '.join(stay[:3])}{'; ...' if len(stay) > 3 else ''})"] if stay else []
        others = {k: v for k, v in self.queue_sizes().items() if v and k not in ("running", "migrating")}
        parts += [f"queued {others}"] if others else []
        return ", ".join(parts) or "nothing left"

    def _with_migrations(self, p: PendingSwitch, reply: SwitchModeResp) -> SwitchModeResp:
        if p.migrating:
            n = self.s.migrator.migrated - p.migrated_before
            reply.message += f"; {n} request{'s' if n != 1 else ''} migrated to other servers"
            reply.migrated = n
        return reply

    def _draining_for_reversal(self, p: PendingSwitch) -> None:
        """Switch back once the new role's own requests are gone; past the timeout the handover goes on."""
        waited = time.monotonic() - p.drain_started
        if self._reversible() or (self.s.drain() and self._reversible()):
            self.pending = None
            p.timings_ms["drain"] = round(waited * 1000, 3)
            self.s.replies.append(self._reverse(p))
        elif any_rank(self.tp, waited > p.msg.timeout_s):
            self.pending = None
            self.state, self.target = TransitionState.HANDOVER, None
            self.last_error = f"drain timed out after {p.msg.timeout_s}s"
            self.s.replies.append(self._reply(p.msg, 504, f"{self.last_error}; {self._still_handing_over()}"))

    def _still_handing_over(self) -> str:
        role = self.s.role
        return f"still serving as {role.name}, the {role.old.name} role finishing its requests (handover)"

    def _during_handover(self) -> None:
        """Retire the old role once every rank finds it holds nothing, then start the switch queued
        behind it; a queued switch that waited past its timeout is answered 504."""
        q = self.queued
        if not any_rank(self.tp, not self.s.role.retired()):
            self._retire()
            self.queued = None
            reply = None if q is None else self._begin(q.msg, q.drain_started)
            if reply is not None:
                self.s.replies.append(reply)
        elif q is not None and any_rank(self.tp, time.monotonic() - q.drain_started > q.msg.timeout_s):
            self.queued = None
            self.last_error = f"a switch to {q.msg.mode} timed out: the handover did not end within {q.msg.timeout_s}s"
            self.s.replies.append(self._reply(q.msg, 504, f"the handover did not end within {q.msg.timeout_s}s; "
                                                          f"still serving as {self.s.role.name}"))

    # ------------------------------------------------------------------ the switch

    def _switch(self, p: PendingSwitch) -> SwitchModeResp:
        s, mode = self.s, p.msg.mode
        t0 = time.monotonic()
        self.state = TransitionState.SWITCHING
        old_role, old_cache = s.role, s.tree_cache
        made: dict[str, Any] = {"role": None, "cache": None}

        def check() -> None:
            self.faults.check("check", self.target)
            self._check_quiescent(p.handover, self._keeps_cache(mode))

        def cache() -> None:
            made["cache"] = self._cache_for(mode, p.msg.flush_cache)
            self.faults.check("cache", self.target)

        def init() -> None:
            made["role"] = self.idle_roles.pop(mode, None) or self._build_role(mode, activate=False)
            self.faults.check("init", self.target)

        def bootstrap() -> None:
            # prefill: rank 0 starts the bootstrap server (port in use = failure); after
            # every rank agreed it is up, every rank registers with it
            if hasattr(made["role"], "start_bootstrap"):
                made["role"].start_bootstrap()

        def activate() -> None:
            made["role"].activate()
            self.faults.check("bootstrap", self.target)

        def commit() -> None:
            self.faults.check("commit", self.target)

        failure = self._agreed_steps((check, cache, init, bootstrap, activate, commit))
        if failure is not None:
            return self._rollback(p, failure, old_role, old_cache, made["role"])
        held = self._held(old_role)
        self._commit(p, old_role, old_cache, made["role"], made["cache"])
        text = f"switched from {old_role.name} to {mode}"
        if p.handover and held:
            text += (f"; the {held} request{'s' if held != 1 else ''} the {old_role.name} role held finish under "
                     f"{mode} (handover)")
        elif p.handover:
            text += f"; the {old_role.name} role held no request (handover)"
        return self._switched(p, t0, text)

    def _agreed_steps(self, steps: tuple) -> Optional[tuple[str, int]]:
        """Run the steps in order, every TP rank agreeing after each; the first failure (why, HTTP status), or
        None when all succeeded."""
        for step in steps:
            error = None
            try:
                step()
            except Exception as e:
                error = e
            failure = agree(self.tp, step.__name__, error)
            if failure is not None:
                return failure
        return None

    def _held(self, role) -> int:
        """The requests the server holds, `role`'s own queues counted."""
        s = self.s
        return len(s.live_reqs()) + len(s.waiting_queue) + len(role.queued_reqs())

    def _switched(self, p: PendingSwitch, t0: float, text: str) -> SwitchModeResp:
        """A committed switch's timings, log line and 200 answer."""
        p.timings_ms["switch"] = round((time.monotonic() - t0) * 1000, 3)
        p.timings_ms.setdefault("drain", 0.0)
        self.last_timings_ms = dict(p.timings_ms)
        self.last_error = None
        logger.info("%s (epoch %d) in %.1f ms", text, self.epoch, p.timings_ms["switch"])
        return self._reply(p.msg, 200, text, p.timings_ms)

    def _reverse(self, p: PendingSwitch) -> SwitchModeResp:
        """The old role of a handover serves again, with what it still holds; the new role goes. A step that
        fails leaves the handover as it was."""
        s, role, mode = self.s, self.s.role, p.msg.mode
        t0 = time.monotonic()
        self.state = TransitionState.SWITCHING
        made: dict[str, Any] = {"cache": None}

        def check() -> None:
            self.faults.check("check", self.target)
            if not self._reversible():
                raise SwitchFailed(f"the {role.name} role holds requests of its own ({self._own_work()})", 503)

        def cache() -> None:  # where the handover replaced the cache, one of the kind the old role had
            if role.replaced_cache:
                made["cache"] = self._cache_for(mode, p.msg.flush_cache, radix=not self._wants_radix(role.new.name))
            self.faults.check("cache", self.target)

        def commit() -> None:
            self.faults.check("commit", self.target)

        failure = self._agreed_steps((check, cache, commit))
        if failure is not None:
            why, code = failure
            self.state, self.target = TransitionState.HANDOVER, None
            self.last_error = f"switch back to {mode} failed{why}"
            logger.warning("%s; the handover to %s goes on", self.last_error, role.name)
            return self._reply(p.msg, code, f"{self.last_error}; {self._still_handing_over()}")
        held = self._held(role.old)
        if made["cache"] is not None:
            s.tree_cache.flush()  # nothing in it is locked (checked): every request owns its KV
            s.set_cache(made["cache"])
            role.reroot(made["cache"].root_node)
        s.role = role.old
        self._dispose(role.new)
        self.epoch += 1
        self._to_idle()
        return self._switched(p, t0, f"switched back from {role.name} to {mode} during its handover; the {held} "
                                     f"request{'s' if held != 1 else ''} held go on under {mode}")

    def _check_quiescent(self, handover: bool, keeps_cache: bool) -> None:
        """Nothing runs (a handover: no pass in flight, nor a chunked prefill where the prefix cache is
        replaced; the requests it hands over keep their locks in a prefix cache that stays, and hold none in
        one that is replaced)."""
        if handover:
            if self.s.inflight is not None:
                raise SwitchFailed("a pass is in flight", 503)
            if self.s.chunked_req is not None and not keeps_cache:
                raise SwitchFailed("a chunked prefill is in flight", 503)
            return
        if not self.s.is_idle():
            raise SwitchFailed(f"queues not empty: {self.queue_sizes()}", 503)
        if self.s.tree_cache.protected_size() > 0:
            raise SwitchFailed("the prefix cache still has locked entries")

    def _cache_for(self, mode: str, flush: bool, radix: Optional[bool] = None):
        """The cache the target role needs (None: keep the current one; `radix`: of that kind). Nothing is
        freed yet."""
        mem = self.s.mem
        if radix is None and self._keeps_cache(mode):
            return None
        want_radix = self._wants_radix(mode) if radix is None else radix
        if not want_radix and self.s.tree_cache.total_size() > 0 and not flush:
            raise SwitchFailed("decode needs an empty prefix cache: it holds entries and flush_cache is false", 409)
        return mem.make_cache(radix=want_radix)

    def _build_role(self, mode: str, activate: bool):
        from tidal.roles import create_role

        return create_role(mode, self.s, activate=activate)

    def _commit(self, p: PendingSwitch, old_role, old_cache, new_role, new_cache) -> None:
        """The new role serves from now on. After a handover the old role stays beside it with what it holds:
        a decode role's requests were placed under a prefix cache without sharing, so under a new radix cache
        they own all their KV and lock nothing (the tree takes it when they end); a null role's keep their
        locks in the radix cache, which stays."""
        s = self.s
        if new_cache is not None:
            old_cache.flush()  # frees its slots; it held no locks (checked), or nothing (without sharing)
            s.set_cache(new_cache)
        self.epoch += 1
        if not p.handover:
            s.role = new_role
            self._dispose(old_role)
            self._to_idle()
            return
        s.role = HandoverRole(s, new_role, old_role)
        if new_cache is not None:
            s.role.reroot(new_cache.root_node)
        self.state, self.target = TransitionState.HANDOVER, None
        self.handover_started = time.monotonic()

    def _retire(self) -> None:
        """The old role of a handover holds nothing more: it goes."""
        role = self.s.role
        self.s.role = role.new
        self._dispose(role.old)
        self.last_timings_ms["handover"] = round((time.monotonic() - self.handover_started) * 1000, 3)
        logger.info("handover to %s done: the %s role finished its requests in %.1f s", role.name, role.old.name,
                    self.last_timings_ms["handover"] / 1000)
        self._to_idle()

    def _dispose(self, role) -> None:
        role.deactivate()
        if self.keep_components:
            self.idle_roles[role.name] = role
        else:
            role.shutdown()

    def _rollback(self, p: PendingSwitch, failure: tuple[str, int], old_role, old_cache,
                  new_role) -> SwitchModeResp:
        self.state = TransitionState.ROLLBACK
        why, code = failure
        logger.warning("switch to %s failed%s; rolling back to %s", p.msg.mode, why, old_role.name)
        if new_role is not None:
            try:
                new_role.shutdown()
            except Exception:
                logger.exception("releasing the half-started %s role failed", p.msg.mode)
        self.s.role = old_role
        if self.s.tree_cache is not old_cache:
            self.s.set_cache(old_cache)
        self.last_error = f"switch to {p.msg.mode} failed{why}"
        self._to_idle()
        return self._reply(p.msg, code, f"{self.last_error}; rolled back, still serving as {old_role.name}")

    def _to_idle(self) -> None:
        self.state, self.target = TransitionState.IDLE, None

    # ------------------------------------------------------------------ reporting

    def queue_sizes(self) -> dict:
        s = self.s
        return {"waiting": len(s.waiting_queue), "running": len(s.live_reqs()), **s.role.queue_sizes(),
                **s.migrator.queue_sizes()}

    def _reply(self, msg: Any, code: int, message: str, timings: Optional[dict] = None) -> SwitchModeResp:
        return SwitchModeResp(call_id=msg.call_id, status_code=code, status="ok" if code == 200 else "error",
                              message=message, current_mode=self.s.role.name, epoch=self.epoch,
                              timings_ms=timings or {})

    def status(self, call_id: int) -> ModeStatusResp:
        initialized = [self.s.role.name, *self.idle_roles]
        target = self.target or (self.queued.msg.mode if self.queued is not None else None)  # queued: after the handover
        return ModeStatusResp(
            call_id=call_id, current_mode=self.s.role.name, transition_state=self.state.value,
            target_mode=target, epoch=self.epoch, last_error=self.last_error,
            initialized_roles=sorted(set(initialized)), queue_sizes=self.queue_sizes(),
            last_switch_timings_ms=self.last_timings_ms, enabled=self.enabled,
        )

    def shutdown(self) -> None:
        for role in self.idle_roles.values():
            role.shutdown()
        self.idle_roles.clear()

