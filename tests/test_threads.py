"""Threads and CPUs: the core-count/affinity computation (tidal.cpus), a real server's API
process (no thread pools next to the scheduler's) and its /server_info, and a real cluster's
members on disjoint CPUs."""

from __future__ import annotations

import os
import sys

import httpx
import psutil
import pytest

from servers import Server, free_port, free_port_block
from tidal.cpus import (
    compute_threads,
    format_cpu_list,
    parse_cgroup_cpu_max,
    parse_cpu_list,
    physical_cores,
    plan_member,
    set_server_env,
    split_cores,
    usable_cpus,
)


def smt_siblings(num_cores: int):
    """A host with SMT on: CPU c and c + num_cores share a core (Linux's usual numbering)."""
    return lambda c: [c % num_cores, c % num_cores + num_cores]


def test_cgroup_cpu_max_parsing():
    assert parse_cgroup_cpu_max("max 100000\n") is None
    assert parse_cgroup_cpu_max("200000 100000\n") == 2.0
    assert parse_cgroup_cpu_max("150000 100000") == 1.5
    assert parse_cgroup_cpu_max("25000 50000") == 0.5


def test_cpu_list_round_trip():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("0,64") == [0, 64]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_threads_follow_quota_and_are_never_zero():
    assert compute_threads(4, None) == 4
    assert compute_threads(4, 2.5) == 2
    assert compute_threads(4, 0.5) == 1
    assert compute_threads(0, None) == 1


def test_smt_siblings_count_once():
    cores = physical_cores(range(8), smt_siblings(4))
    assert cores == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert physical_cores([0, 4, 1], smt_siblings(4)) == [(0, 4), (1,)]  # only allowed CPUs
    plan = plan_member(0, 1, pin=True, cpus=list(range(8)), siblings=smt_siblings(4))
    assert plan.threads == 4 and plan.cpus is None  # 4 cores, not 8 hyperthreads; one member keeps its mask


def test_split_cores_disjoint_whole_cores_or_none():
    cores = [(c,) for c in range(5)]
    sets = split_cores(cores, 3)
    assert [len(s) for s in sets] == [2, 2, 1]
    assert sorted(c for s in sets for c in s) == list(range(5))
    assert split_cores([(0,), (1,)], 3) is None
    smt = split_cores(physical_cores(range(8), smt_siblings(4)), 2)
    assert smt == [[0, 1, 4, 5], [2, 3, 6, 7]]  # siblings stay with their core


def test_plan_members_pinned_shared_and_under_quota():
    cpus = list(range(8))
    plans = [plan_member(m, 2, pin=True, cpus=cpus, siblings=smt_siblings(4)) for m in range(2)]
    assert [p.threads for p in plans] == [2, 2]
    assert not set(plans[0].cpus) & set(plans[1].cpus)
    shared = [plan_member(m, 3, pin=True, cpus=[0, 1], siblings=lambda c: [c]) for m in range(3)]
    assert all(p.threads == 1 and p.cpus is None for p in shared)  # 3 members, 2 cores: share, 1 each
    unpinned = plan_member(1, 2, pin=False, cpus=cpus, siblings=smt_siblings(4))
    assert unpinned.cpus is None and unpinned.threads == 2
    assert plan_member(0, 1, pin=True, cpus=cpus, cpu_limit=1.5, siblings=smt_siblings(4)).threads == 1
    assert plan_member(0, 2, pin=True, cpus=cpus, cpu_limit=3.0, siblings=smt_siblings(4)).threads == 1


def test_this_host_cores_cover_its_cpus():
    cpus = usable_cpus()
    cores = physical_cores(cpus)
    assert 1 <= len(cores) <= len(cpus)
    assert sorted(c for core in cores for c in core) == cpus


def test_server_env_keeps_the_users_choices():
    env: dict[str, str] = {"XDG_CACHE_HOME": "/c"}
    set_server_env(env)
    assert env == {"XDG_CACHE_HOME": "/c", "TORCHINDUCTOR_CACHE_DIR": "/c/tidal/inductor",
                   "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    env = {"GOMP_SPINCOUNT": "1000", "TOKENIZERS_PARALLELISM": "true", "TORCHINDUCTOR_CACHE_DIR": "/mine"}
    set_server_env(env)
    assert env == {"GOMP_SPINCOUNT": "1000", "TOKENIZERS_PARALLELISM": "true", "TORCHINDUCTOR_CACHE_DIR": "/mine"}


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.timeout(600)
def test_api_process_starts_no_thread_pool_under_load_and_server_info_reports_threads():
    server = Server()
    try:
        api = psutil.Process(server.proc.pid)
        before = thread_count(api.pid)
        for text in ("Hello", "The quick brown fox " * 50):  # tokenizers' first encode starts its Rayon pool
            body = {"text": [text] * 4, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            assert httpx.post(server.url + "/generate", json=body, timeout=300).status_code == 200
        assert thread_count(api.pid) == before  # no pool of one thread per CPU next to the scheduler
        info = httpx.get(server.url + "/server_info", timeout=30).json()
        assert info["torch_threads"] == len(physical_cores(usable_cpus()))
        assert info["cpu_affinity"] == [format_cpu_list(usable_cpus())]
        (scheduler,) = [c for c in api.children() if any("spawn_main" in a for a in c.cmdline())]
        assert scheduler.num_threads() <= info["torch_threads"] + 6  # main, ZMQ's 2, torch/python helpers
    finally:
        server.stop()


def port_of(p: psutil.Process) -> int:
    cmd = p.cmdline()
    return int(cmd[cmd.index("--port") + 1])


@pytest.mark.timeout(600)
@pytest.mark.skipif(len(physical_cores(usable_cpus())) < 2, reason="pinning 2 servers needs 2 physical cores")
def test_cluster_members_run_on_disjoint_cpus():
    port, base = free_port(), free_port_block(4)
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", "shm", "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(free_port()), "--server-args", "--max-total-tokens 4096 --dtype float32"]
    cluster = Server(cmd=cmd, port=port)
    try:
        member_cpus = []
        for url in (f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"):
            info = httpx.get(url + "/server_info", timeout=30).json()
            (affinity,) = info["cpu_affinity"]
            assert info["torch_threads"] == len(physical_cores(parse_cpu_list(affinity)))
            member_cpus.append(set(parse_cpu_list(affinity)))
        assert not member_cpus[0] & member_cpus[1]
        servers = [p for p in psutil.Process(cluster.proc.pid).children() if "tidal.launch_server" in p.cmdline()]
        for server, cpus in zip(sorted(servers, key=port_of), member_cpus):
            for p in (server, *server.children(recursive=True)):
                assert set(p.cpu_affinity()) == cpus  # the API process and its scheduler alike
    finally:
        cluster.stop()


def test_small_passes_run_on_one_thread_and_the_rest_on_all(monkeypatch):
    import threading

    import torch

    from tidal.config import ServerArgs
    from tidal.model.runner import PassThreads

    with pytest.raises(ValueError, match="--one-thread-max-tokens"):
        ServerArgs(one_thread_max_tokens=-1).validate()
    seen = {}

    def passes():  # in its own thread, as the overlap scheduler's forward runs: the count is per thread
        threads = PassThreads(threads=2, one_thread_max_tokens=1)
        for tokens in (1, 8, 1, 0):
            threads.set_for(tokens)
            seen.setdefault(tokens, []).append(torch.get_num_threads())
        PassThreads(threads=2, one_thread_max_tokens=0).set_for(1)  # 0: every pass on all threads
        seen["off"] = torch.get_num_threads()

    worker = threading.Thread(target=passes)
    worker.start()
    worker.join(timeout=30)
    assert seen == {1: [1, 1], 8: [2], 0: [1], "off": 2}
