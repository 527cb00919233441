"""Role strategies plugged into the one scheduler loop: null (colocated), prefill, decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.scheduler.scheduler import Scheduler


def create_role(mode: str, sched: "Scheduler"):
    """Build a role's components (imported lazily: only a PD role needs the transfer layer)."""
    if mode == "null":
        from tidal.roles.null import NullRole

        return NullRole(sched)
    if mode == "prefill":
        from tidal.roles.prefill import PrefillRole

        return PrefillRole(sched)
    if mode == "decode":
        from tidal.roles.decode import DecodeRole

        return DecodeRole(sched)
    raise ValueError(f"unknown role {mode!r}")
