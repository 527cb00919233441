"""What a dying tidal process must not leave behind: shared memory, and a slow exit.

Names of tidal's POSIX shared-memory segments, and the sweep of those whose owner died.

Every segment tidal creates in /dev/shm is named `tidal-<kind>-<pid>-s<start>-<random>`:
`pid` is the owner, the process whose death makes the segment garbage, and `start` its
start time (clock ticks since boot, /proc/<pid>/stat field 22), so that a new process that
reuses the PID does not keep a dead owner's segment alive. Owners: a scheduler rank owns
its shared KV pool (kind `kv`); the API process owns the TP communicator segment (kind
`tp`) that its ranks map. A process killed with SIGKILL cannot unlink what it owns, so
every tidal process that can notice a death (the API process at startup and when a
scheduler dies, the `tidal cluster` supervisor when a member dies and at stop) sweeps.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import uuid
from typing import NoReturn, Optional

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^tidal-([a-z]+)-(\d+)-s(\d+)-")


def process_start_time(pid: int) -> Optional[int]:
    """Start time of `pid` in clock ticks since boot; None if it is gone, a zombie, or unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def owned_segment_name(kind: str, pid: Optional[int] = None) -> str:
    """A fresh segment name owned by `pid` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return f"tidal-{kind}-{pid}-s{process_start_time(pid) or 0}-{uuid.uuid4().hex[:8]}"


def segment_owner(name: str) -> Optional[tuple[int, int]]:
    """(pid, start time) of a tidal segment name; None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(2)), int(m.group(3))) if m else None


def owner_alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    if not os.path.isdir("/proc"):
        return True  # no /proc (not Linux): PID reuse and zombies cannot be told apart
    now = process_start_time(pid)
    return now is not None and (start == 0 or now == start)


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every tidal segment in `shm_dir` whose owner is dead; returns their names."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in names:
        owner = segment_owner(name)
        if owner is None or owner_alive(*owner):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue  # another sweeper was first
        except OSError as e:
            logger.warning("cannot remove stale shared memory %s/%s: %s", shm_dir, name, e)
            continue
        removed.append(name)
    if removed:
        logger.warning("removed shared memory left by dead processes: %s", ", ".join(removed))
    return removed


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown (module and torch finalisation), which took
    1.5-6 s per process on a busy 2-core host. Only for a process's last act, once everything
    it owns (children, sockets, shared memory, temp files) was released explicitly."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
