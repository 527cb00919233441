"""`tidal cluster`: prefill, decode (and null) servers plus the router on one machine.

Every server is a child process; Ctrl-C / SIGTERM stops them all, and the death of
any one stops the rest, so nothing is left behind: once every process of the cluster is
gone, the shared memory that a member killed with SIGKILL could not remove is swept.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import httpx
import psutil

from tidal.config import KEY_ENV_VARS, TRANSFER_BACKENDS, default_model_path, keys_from_env
from tidal.cpus import CpuPlan, cgroup_cpu_limit, plan_member, usable_cpus
from tidal.leftovers import sweep_stale_segments
from tidal.planner.flags import add_planner_args, planner_argv, planner_config_from_namespace
from tidal.profile.schema import profile_error
from tidal.router.policies import POLICIES

READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 15.0
DESCENDANT_EXIT_S = 2.0  # a dead server's scheduler ranks get SIGKILL from the kernel (PDEATHSIG)
POLL_S = 0.1
# kv_aware's default for every server: events and replay on free ports of the server's host
FREE_PORT_KV_EVENTS = '{"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--prefill", type=int, default=1, help="number of prefill servers")
    a("--decode", type=int, default=1, help="number of decode servers")
    a("--worker", type=int, default=0, help="number of null-role (colocated) servers")
    a("--model-path", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    a("--host", default="127.0.0.1", help="address every server and the router listen on; 127.0.0.1 keeps them local")
    a("--port", type=int, default=8000, help="router port")
    a("--base-port", type=int, default=30000, help="first server port")
    a("--bootstrap-base-port", type=int, default=8998, help="first prefill bootstrap port")
    a("--disaggregation-transfer-backend", default="shm", choices=TRANSFER_BACKENDS, help="KV transfer backend of every server")
    a("--policy", default="cache_aware", choices=POLICIES,
      help="the router's policy: how a worker is picked for a request (kv_aware: every server publishes KV events "
           "on free ports unless --server-args sets --kv-events-config)")
    a("--torch-threads", type=int, default=None,
      help="torch threads per server (default: the physical cores of its own CPU set when pinned, else "
           "physical cores // servers, at least 1)")
    a("--disable-cpu-pinning", action="store_true",
      help="do not pin each server (and, with --tp, each rank) to its own physical cores (default: pinned when "
           "there are at least as many cores as servers; with fewer they share all CPUs, 1+ thread each)")
    a("--server-args", default="",
      help="extra flags for every server, as one quoted string (default: none; the cluster already passes each "
           "server --torch-threads (see above) and --mem-fraction-static 0.5/servers, which these override)")
    a("--api-key", default=None,
      help="API key of every server and of the router, passed to them in their environment "
           "(default: $TIDAL_API_KEY, else none)")
    a("--admin-api-key", default=None,
      help="admin key of every server and of the router; the router uses it on the servers' admin routes "
           "(default: $TIDAL_ADMIN_API_KEY, else none)")
    add_planner_args(p)  # passed on to the router; with --planner sla the servers may switch roles


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    url: Optional[str] = None


def _server_cmd(ns: argparse.Namespace, mode: str, port: int, bootstrap_port: Optional[int], threads: int,
                num_servers: int) -> list[str]:
    # the servers share this machine's memory: split the default KV budget (--server-args overrides)
    cmd = [sys.executable, "-m", "tidal.launch_server", "--host", ns.host, "--port", str(port),
           "--disaggregation-mode", mode, "--disaggregation-transfer-backend", ns.disaggregation_transfer_backend,
           "--torch-threads", str(threads), "--mem-fraction-static", f"{0.5 / num_servers:.4f}"]
    if ns.model_path:
        cmd += ["--model-path", ns.model_path]
    if bootstrap_port is not None:
        cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if ns.disable_cpu_pinning:
        cmd += ["--disable-cpu-pinning"]
    if ns.planner != "static":
        cmd += ["--enable-dynamic-disaggregation"]
    extra = shlex.split(ns.server_args)
    if ns.policy == "kv_aware" and "--kv-events-config" not in extra:
        cmd += ["--kv-events-config", FREE_PORT_KV_EVENTS]  # each server reports its ports in /server_info
    return cmd + extra


def plan_cpus(ns: argparse.Namespace, num_servers: int) -> list[CpuPlan]:
    """Each server's share of this machine's CPUs (see tidal.cpus.plan_member)."""
    limit = cgroup_cpu_limit()
    plans = [plan_member(i, num_servers, pin=not ns.disable_cpu_pinning, cpu_limit=limit) for i in range(num_servers)]
    return [CpuPlan(ns.torch_threads or p.threads, p.cpus) for p in plans]


def _pin_to(cpus: Optional[list[int]]):
    """Popen preexec_fn: the server and every process it starts run on cpus (None: no change)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def _child_env(ns: argparse.Namespace, router: bool = False) -> dict[str, str]:
    """The keys go to the children in their environment, never on a (world-readable) command line."""
    keys = {"api_key": ns.api_key, "admin_api_key": ns.admin_api_key}
    if router:
        keys["worker_admin_api_key"] = ns.admin_api_key
    env = {k: v for k, v in os.environ.items() if k not in KEY_ENV_VARS.values()}
    env.update({KEY_ENV_VARS[name]: value for name, value in keys.items() if value})
    return env


def plan_servers(ns: argparse.Namespace) -> list[tuple[str, str, int, Optional[int]]]:
    """(name, mode, port, bootstrap_port) of every server: prefill servers have a bootstrap port,
    and so has every server when the planner may move it to prefill."""
    plan, port = [], ns.base_port
    movable = ns.planner != "static"
    for i in range(ns.prefill):
        plan.append((f"prefill-{i}", "prefill", port, ns.bootstrap_base_port + i))
        port += 1
    for i in range(ns.decode):
        plan.append((f"decode-{i}", "decode", port, ns.bootstrap_base_port + ns.prefill + i if movable else None))
        port += 1
    for i in range(ns.worker):
        plan.append((f"worker-{i}", "null", port,
                     ns.bootstrap_base_port + ns.prefill + ns.decode + i if movable else None))
        port += 1
    return plan


def _router_cmd(ns: argparse.Namespace, plan: list) -> list[str]:
    cmd = [sys.executable, "-m", "tidal.router", "--host", ns.host, "--port", str(ns.port), "--policy", ns.policy,
           *planner_argv(ns)]
    if ns.policy == "kv_aware":  # the router tokenizes prompts as the servers do
        cmd += ["--model-path", ns.model_path or default_model_path()]
    for _, mode, port, bport in plan:
        url = f"http://{ns.host}:{port}"
        if mode == "prefill":
            cmd += ["--prefill", url, str(bport)]
        elif mode == "decode":
            cmd += ["--decode", url]
        else:
            cmd += ["--worker", url]
    return cmd


def _wait_healthy(children: list[Child], deadline: float, stop: dict) -> None:
    pending = [c for c in children if c.url]
    while pending:
        if stop["signal"]:
            raise RuntimeError("interrupted while starting")
        for c in list(pending):
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} while starting")
            try:
                if httpx.get(c.url + "/health", timeout=2).status_code == 200:
                    pending.remove(c)
                    print(f"[cluster] {c.name} ready at {c.url}", flush=True)
            except httpx.HTTPError:
                pass
        if time.time() > deadline:
            raise TimeoutError(f"not ready in time: {[c.name for c in pending]}")
        time.sleep(0.5)


def _descendants(children: list[Child]) -> list[psutil.Process]:
    procs = []
    for c in children:
        try:
            procs += psutil.Process(c.proc.pid).children(recursive=True)
        except psutil.Error:
            pass  # exited: its ranks are dying with it
    return procs


def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
    """psutil.wait_procs polls non-children slowly (~1 s here); this checks every 20 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_running(p) for p in procs):
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_all(children: list[Child]) -> None:
    """SIGTERM every member, SIGKILL those still there after STOP_TIMEOUT_S, wait for their
    descendants (scheduler ranks), then sweep the shared memory the dead left."""
    descendants = _descendants(children)
    for c in reversed(children):
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + STOP_TIMEOUT_S
    for c in reversed(children):
        try:
            c.proc.wait(max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
    _wait_gone(descendants, DESCENDANT_EXIT_S)
    sweep_stale_segments()


def planner_problem(ns: argparse.Namespace) -> str:
    """What the router would refuse in the planner flags ("" when nothing), found before any server loads."""
    from tidal.planner.loop import load_cost_model

    try:
        planner_config_from_namespace(ns)
    except ValueError as e:
        return f"error: planner: {e}"
    try:
        load_cost_model(ns.planner_profile)
    except (OSError, ValueError) as e:  # a profile's format error is a ValueError
        return f"error: {profile_error('--planner-profile', ns.planner_profile, e)}"
    return ""


def run_cluster(ns: argparse.Namespace) -> int:
    keys_from_env(ns)
    plan = plan_servers(ns)
    if not any(m == "null" for _, m, _, _ in plan) and (ns.prefill < 1 or ns.decode < 1):
        print("[cluster] needs at least one prefill and one decode server (or --worker)", file=sys.stderr)
        return 2
    problem = planner_problem(ns)
    if problem:
        print(f"[cluster] {problem}", file=sys.stderr)
        return 2
    cpu_plans = plan_cpus(ns, len(plan))
    children: list[Child] = []
    stop = {"signal": False}

    def on_signal(*_):
        stop["signal"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for (name, mode, port, bport), cpus in zip(plan, cpu_plans):
            print(f"[cluster] {name}: {cpus.describe(usable_cpus())}", flush=True)
            proc = subprocess.Popen(_server_cmd(ns, mode, port, bport, cpus.threads, len(plan)), env=_child_env(ns),
                                    preexec_fn=_pin_to(cpus.cpus))
            children.append(Child(name, proc, f"http://{ns.host}:{port}"))
        _wait_healthy(children, time.time() + READY_TIMEOUT_S, stop)
        router = Child("router", subprocess.Popen(_router_cmd(ns, plan), env=_child_env(ns, router=True)),
                       f"http://{ns.host}:{ns.port}")
        children.append(router)
        _wait_healthy([router], time.time() + 60, stop)
        print(f"[cluster] serving at {router.url} ({ns.prefill} prefill, {ns.decode} decode, "
              f"{ns.worker} null); Ctrl-C stops everything", flush=True)
        while not stop["signal"]:
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"[cluster] {dead[0].name} exited ({dead[0].proc.returncode}); stopping", file=sys.stderr)
                sweep_stale_segments()  # now, in case the stop below is itself interrupted
                return 1
            time.sleep(POLL_S)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"[cluster] {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(children)
