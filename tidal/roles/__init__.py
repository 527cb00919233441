"""Role strategies plugged into the one scheduler loop: null (colocated), prefill, decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.roles.loop import RoleLoop


def create_role(mode: str, sched: RoleLoop, activate: bool = True):
    """Build a role's components (imported lazily: only a PD role needs the transfer layer).

    An inactive role holds its components but serves no one (a prefill role's bootstrap
    server is down); `activate()` makes it reachable.
    """
    if mode == "null":
        from tidal.roles.null import NullRole

        return NullRole(sched)
    if mode == "prefill":
        from tidal.roles.prefill import PrefillRole

        role = PrefillRole(sched)
    elif mode == "decode":
        from tidal.roles.decode import DecodeRole

        role = DecodeRole(sched)
    else:
        raise ValueError(f"unknown role {mode!r}")
    if activate:
        try:
            role.activate()
        except BaseException:
            role.shutdown()
            raise
    return role
    raise ValueError(f"unknown role {mode!r}")
