"""The sweep of shared-memory segments whose owner died (tidal/leftovers.py), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tidal.leftovers import owned_segment_name, process_start_time, segment_owner, sweep_stale_segments


def touch(d, name: str) -> str:
    open(os.path.join(d, name), "w").close()
    return name


def test_sweep_removes_segments_of_dead_zombie_and_reused_pids_only(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exited, not reaped yet
    while process_start_time(zombie.pid) is not None:
        time.sleep(0.01)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = touch(tmp_path, owned_segment_name("kv"))
        live_child = touch(tmp_path, owned_segment_name("tp", live.pid))
        dead_owner = touch(tmp_path, f"tidal-kv-{dead.pid}-s1-0000abcd")
        zombie_owner = touch(tmp_path, owned_segment_name("kv", zombie.pid).replace("-s0-", "-s1-"))
        reused_pid = touch(tmp_path, f"tidal-kv-{os.getpid()}-s{process_start_time(os.getpid()) - 1}-0000abcd")
        other = touch(tmp_path, "psm_12345")
        removed = sweep_stale_segments(str(tmp_path))
        assert sorted(removed) == sorted([dead_owner, zombie_owner, reused_pid])
        assert sorted(os.listdir(tmp_path)) == sorted([mine, live_child, other])
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_segment_names_carry_their_owner():
    name = owned_segment_name("kv")
    assert name.startswith(f"tidal-kv-{os.getpid()}-s")
    assert segment_owner(name) == (os.getpid(), process_start_time(os.getpid()))
    assert segment_owner("tidal-kv-123-456-0000abcd") is None  # not this scheme: never swept
