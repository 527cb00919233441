"""The scheduler's side of multi-LoRA: which adapter a request may use, loading and unloading, and the
--max-loras-per-batch limit on a batch's distinct adapters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

from tidal.messages import LoadLoRAReq, LoRAResp, UnloadLoRAReq
from tidal.scheduler.req import Req

if TYPE_CHECKING:
    from tidal.scheduler.scheduler import Scheduler


class LoRAScheduling:
    def __init__(self, sched: "Scheduler"):
        self.s = sched
        self.manager = getattr(sched.runner, "lora", None)
        self.max_per_batch = sched.args.max_loras_per_batch
        self.users: dict[str, str] = {}  # rid -> adapter of every accepted request not yet finished

    def check(self, name: Optional[str]) -> Optional[str]:
        """Why a request may not use this adapter (None: it may)."""
        if name is None:
            return None
        if self.manager is None:
            return "LoRA is not enabled on this server (start it with --enable-lora)"
        if name not in self.manager.adapters:
            return f"Unknown LoRA adapter {name!r}; loaded: {sorted(self.manager.adapters)}"
        return None

    def on_accepted(self, req: Req) -> None:
        if req.lora_name is not None:
            self.users[req.rid] = req.lora_name

    def on_finished(self, rid: str) -> None:
        self.users.pop(rid, None)

    # ---------------------------------------------------------------- load / unload

    def load(self, msg: LoadLoRAReq) -> LoRAResp:
        from tidal.model.lora import LoRAError

        if self.manager is None:
            return self._reply(msg, 400, "LoRA is not enabled on this server (start it with --enable-lora)")
        try:
            self.manager.load(msg.lora_name, msg.lora_path)
        except LoRAError as e:
            return self._reply(msg, 400, f"Failed to load LoRA adapter {msg.lora_name!r}: {e}")
        except Exception as e:  # a broken file (bad JSON, truncated safetensors, ...) is the caller's input too
            return self._reply(msg, 400, f"Failed to load LoRA adapter {msg.lora_name!r}: {type(e).__name__}: {e}")
        return self._reply(msg, 200, f"LoRA adapter {msg.lora_name!r} loaded.")

    def unload(self, msg: UnloadLoRAReq) -> LoRAResp:
        """Refused (400) while a request that uses the adapter is queued or running."""
        name = msg.lora_name
        if self.manager is None:
            return self._reply(msg, 400, "LoRA is not enabled on this server (start it with --enable-lora)")
        if name not in self.manager.adapters:
            return self._reply(msg, 400, f"No LoRA adapter named {name!r} is loaded.")
        busy = sum(1 for n in self.users.values() if n == name)
        if busy:
            return self._reply(msg, 400, f"LoRA adapter {name!r} is in use by {busy} requests; retry when they finish.")
        self.manager.unload(name)
        self.s.mem.tree_cache.drop_namespace(name)  # a later adapter of this name must not reuse its KV
        return self._reply(msg, 200, f"LoRA adapter {name!r} unloaded.")

    def _reply(self, msg, code: int, text: str) -> LoRAResp:
        adapters = self.manager.paths() if self.manager is not None else {}
        return LoRAResp(call_id=msg.call_id, success=code == 200, status_code=code, message=text, adapters=adapters)

    # ---------------------------------------------------------------- batching

    def admissible(self, waiting: list[Req], holders: Iterable[Req]) -> list[Req]:
        """The waiting requests, in order, whose adapters keep the batch within --max-loras-per-batch
        distinct adapters next to `holders` (the requests every decode batch holds)."""
        if self.manager is None:
            return waiting
        active = {r.lora_name for r in holders if r.lora_name is not None}
        out = []
        for r in waiting:
            if r.lora_name is None or r.lora_name in active:
                out.append(r)
            elif len(active) < self.max_per_batch:
                active.add(r.lora_name)
                out.append(r)
        return out

    def fits(self, req: Req, holders: Iterable[Req]) -> bool:
        return bool(self.admissible([req], holders))
