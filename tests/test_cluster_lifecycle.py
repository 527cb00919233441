"""`tidal cluster` stops fast and leaves nothing behind: no process, no /dev/shm/tidal-* segment.

Real clusters (1 prefill + 1 decode + router, shm KV transfer, so every scheduler owns a
shared KV pool) on the default model.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from servers import Server, free_port, free_port_block

pytestmark = pytest.mark.timeout(600)

CTRL_C_STOP_S = 3.0
SCHEDULER_STOP_S = 1.0  # was 1.5-3.8 s: the interpreter's teardown after the loop ended


def start_cluster() -> Server:
    port, base, bport = free_port(), free_port_block(4), free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", "shm", "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(bport), "--torch-threads", "1",
           "--server-args", "--max-total-tokens 4096 --dtype float32"]
    cluster = Server(cmd=cmd, port=port)
    deadline = time.time() + 60
    while "Ctrl-C stops everything" not in open(cluster.log.name).read():  # the supervisor is in its loop
        assert time.time() < deadline, open(cluster.log.name).read()[-3000:]
        time.sleep(0.1)
    return cluster


def cluster_processes(cluster: Server) -> list[psutil.Process]:
    root = psutil.Process(cluster.proc.pid)
    return [root, *root.children(recursive=True)]


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in procs if alive(p)]


def segments_of(pids: set[int]) -> list[str]:
    """/dev/shm/tidal-* names that carry one of `pids` (old and new naming schemes)."""
    wanted = {str(p) for p in pids}
    return [n for n in os.listdir("/dev/shm") if n.startswith("tidal-") and wanted & set(n.split("-"))]


def server_pid(procs: list[psutil.Process], mode: str) -> int:
    for p in procs:
        cmd = p.cmdline()
        if "tidal.launch_server" in cmd and cmd[cmd.index("--disaggregation-mode") + 1] == mode:
            return p.pid
    raise AssertionError(f"no {mode} server among {[p.cmdline() for p in procs]}")


def test_ctrl_c_stops_every_process_within_3s_and_removes_shared_memory():
    cluster = start_cluster()
    try:
        procs = cluster_processes(cluster)
        pids = {p.pid for p in procs}
        assert len(segments_of(pids)) >= 2  # each scheduler's shared KV pool
        t0 = time.monotonic()
        os.killpg(cluster.proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal does
        left = wait_gone(procs, CTRL_C_STOP_S + 5)
        took = time.monotonic() - t0
        assert not left, [p.cmdline() for p in left]
        assert took < CTRL_C_STOP_S, f"the cluster took {took:.2f}s to stop"
        assert cluster.proc.wait(5) == 0
        assert segments_of(pids) == []
    finally:
        cluster.stop()


def test_kill_9_of_a_decode_server_leaves_no_process_and_no_shared_memory():
    cluster = start_cluster()
    try:
        procs = cluster_processes(cluster)
        pids = {p.pid for p in procs}
        decode = server_pid(procs, "decode")
        decode_segments = segments_of({p.pid for p in psutil.Process(decode).children(recursive=True)})
        assert decode_segments, "the decode scheduler has a shared KV pool"
        os.kill(decode, signal.SIGKILL)  # its scheduler gets SIGKILL too (PDEATHSIG): nobody unlinks
        assert cluster.proc.wait(60) == 1  # the supervisor stops the others
        left = wait_gone(procs, 5)
        assert not left, [p.cmdline() for p in left]
        assert segments_of(pids) == []
    finally:
        cluster.stop()


def test_a_scheduler_exits_0_within_1s_of_sigterm():
    server = Server("--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "shm",
                    "--disaggregation-bootstrap-port", str(free_port()), "--torch-threads", "1")
    try:
        ranks = [c for c in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 1 and segments_of({ranks[0].pid})
        t0 = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        left = wait_gone(ranks, 10)
        took = time.monotonic() - t0
        assert not left and took < SCHEDULER_STOP_S, f"the scheduler took {took:.2f}s to exit"
        assert server.proc.wait(30) == 1  # the server stops when its scheduler is gone
        assert "scheduler process stopped (exit code 0)" in open(server.log.name).read()
        assert segments_of({ranks[0].pid}) == []
    finally:
        server.stop()
