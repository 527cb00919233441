"""What every TP rank of a switch agrees on, and the switch's fault-injection test hook.

A role switch runs the same steps on every rank in the same loop iteration; after each step
the ranks exchange their outcomes so that all of them go on, or all roll back, together.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import msgspec

# test hook: the step that fails (check, cache, init, bootstrap, commit): STEP[@RANK][>MODE],
# e.g. "init" (every rank, every switch), "init@1" (TP rank 1 only), "init@1>null" (only
# switches to null)
FAULT_ENV = "TIDAL_SWITCH_FAULT"


class SwitchFailed(Exception):
    def __init__(self, message: str, status_code: int = 500):
        super().__init__(message)
        self.status_code = status_code


def agree(tp: Any, step: str, error: Optional[Exception]) -> Optional[tuple[str, int]]:
    """Every rank's outcome of a step: None if all succeeded, else (why, HTTP status) of the lowest
    failing rank, the same on every rank."""
    if tp.size == 1:
        if error is None:
            return None
        return f": {error}", error.status_code if isinstance(error, SwitchFailed) else 500
    mine = b"" if error is None else msgspec.json.encode(
        [str(error), error.status_code if isinstance(error, SwitchFailed) else 500])
    for rank, outcome in enumerate(tp.all_gather_bytes(mine)):
        if outcome:
            why, code = msgspec.json.decode(outcome)
            return f" on TP rank {rank} at step {step!r}: {why}", int(code)
    return None


def any_rank(tp: Any, flag: bool) -> bool:
    """True on every rank when the flag is true on one (clocks differ: a timeout must be common)."""
    if tp.size == 1:
        return flag
    return bool(tp.all_gather_ints([int(flag)]).any())


class FaultInjector:
    """Raises SwitchFailed at the step `TIDAL_SWITCH_FAULT` names, on the ranks and targets it names."""

    def __init__(self, spec: str, rank: int, tp_size: int = 1) -> None:
        self.rank, self.tp_size = rank, tp_size
        spec, _, mode = spec.partition(">")
        step, _, only = spec.partition("@")
        active = bool(step) and not (only and int(only) != rank)
        self.step: Optional[str] = step if active else None
        self.mode: Optional[str] = (mode or None) if active else None

    @classmethod
    def from_env(cls, rank: int, tp_size: int) -> "FaultInjector":
        return cls(os.environ.get(FAULT_ENV) or "", rank, tp_size)

    def check(self, step: str, target: Optional[str]) -> None:
        if self.step == step and self.mode in (None, target):
            where = f" on TP rank {self.rank}" if self.tp_size > 1 else ""
            raise SwitchFailed(f"injected fault at step {step!r}{where}")
