"""How many compute threads a tidal process runs and on which CPUs.

The scheduler's torch threads get the physical cores this process may use: the CPUs in
its affinity mask, one per core when SMT siblings are in it, no more than the cgroup CPU
quota allows. Servers of one `tidal cluster`, and the TP ranks of one server, get disjoint
sets of whole cores when there are enough (`split_cores`), else they share all CPUs with
threads = cores // members (at least 1), so the threads never outnumber the cores.
The API process computes nothing heavy: one thread for torch/OpenMP/tokenizers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"
SIBLINGS_PATH = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"

# Environment the API process sets for itself and its scheduler processes (which inherit it)
# before either loads torch or tokenizers; a value the user set is kept.
# TOKENIZERS_PARALLELISM=false: HF tokenizers otherwise starts a Rayon pool of one thread per
# CPU at the first encode, in the API process and in every scheduler rank.
# OMP_WAIT_POLICY=PASSIVE: libgomp's workers otherwise spin after every parallel op, taking the
# CPU from the API process and the other servers; on a shared 2-core host a decode step ran
# 3.5-5.5x faster with it (docs/benchmarks.md, "Threads").
SERVER_ENV = {"TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
SPIN_ENV_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def cpu_flags(path: str = "/proc/cpuinfo") -> list[str]:
    """This host's CPU feature flags (the first processor's), sorted; [] where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return sorted(set(value.split()))
    except OSError:
        pass
    return []


def simd_flags(flags: list[str]) -> list[str]:
    """The flags that decide which kernels run and how fast: AVX*, AMX*, FMA, F16C."""
    return sorted({f for f in flags if f.startswith(("avx", "amx", "fma")) or f == "f16c"})


def inductor_cache_dir(environ=os.environ) -> str:
    """Where a server keeps inductor's compiled graphs and kernels: under the user's cache directory, so
    a restart (or a reboot, which empties inductor's default under /tmp) finds them."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidal", "inductor")


def set_server_env(environ=os.environ) -> None:
    """Sets SERVER_ENV and the inductor cache directory where the user has not chosen (any spin setting
    counts as a choice)."""
    environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir(environ))
    if "TOKENIZERS_PARALLELISM" not in environ:
        environ["TOKENIZERS_PARALLELISM"] = SERVER_ENV["TOKENIZERS_PARALLELISM"]
    if not any(v in environ for v in SPIN_ENV_VARS):
        environ["OMP_WAIT_POLICY"] = SERVER_ENV["OMP_WAIT_POLICY"]


def parse_cpu_list(text: str) -> list[int]:
    """Linux's cpulist format ("0-3,8,10-11") as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def format_cpu_list(cpus) -> str:
    """The inverse of parse_cpu_list: sorted CPUs as ranges ("0-3,8")."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_cgroup_cpu_max(text: str) -> Optional[float]:
    """cgroup v2 cpu.max ("QUOTA PERIOD", QUOTA "max" when unlimited) as CPUs, or None."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    period = int(fields[1]) if len(fields) > 1 else 100_000
    return int(fields[0]) / period


def cgroup_cpu_limit() -> Optional[float]:
    """CPUs this process's cgroup may use per period (v2, else v1), None when unlimited."""
    try:
        with open(CGROUP_V2_CPU_MAX) as f:
            return parse_cgroup_cpu_max(f.read())
    except (OSError, ValueError):
        pass
    try:
        with open(CGROUP_V1_QUOTA) as q, open(CGROUP_V1_PERIOD) as p:
            quota, period = int(q.read()), int(p.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def read_siblings(cpu: int) -> list[int]:
    """The CPUs sharing cpu's physical core (itself included); [cpu] when sysfs does not say."""
    try:
        with open(SIBLINGS_PATH.format(cpu)) as f:
            return parse_cpu_list(f.read()) or [cpu]
    except (OSError, ValueError):
        return [cpu]


def physical_cores(cpus, siblings: Callable[[int], list[int]] = read_siblings) -> list[tuple[int, ...]]:
    """The allowed CPUs grouped by physical core (SMT siblings together), ordered by first CPU."""
    allowed = set(cpus)
    cores = {tuple(sorted(set(siblings(c)) & allowed | {c})) for c in allowed}
    return sorted(cores)


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def compute_threads(num_cores: int, cpu_limit: Optional[float]) -> int:
    """Threads for num_cores cores under a cgroup quota of cpu_limit CPUs: never 0."""
    n = num_cores if cpu_limit is None else min(num_cores, math.floor(cpu_limit + 1e-9))
    return max(1, n)


def split_cores(cores: list[tuple[int, ...]], members: int) -> Optional[list[list[int]]]:
    """Disjoint CPU sets of whole cores, one per member, as even as possible (the first ones get
    the extra cores); None when there are fewer cores than members (they must share)."""
    if members < 1 or len(cores) < members:
        return None
    base, extra = divmod(len(cores), members)
    sets, i = [], 0
    for m in range(members):
        n = base + (1 if m < extra else 0)
        sets.append(sorted(c for core in cores[i:i + n] for c in core))
        i += n
    return sets


@dataclass(frozen=True)
class CpuPlan:
    """What one of `members` processes sharing this process's CPUs gets: `cpus` is None when it
    keeps the inherited affinity (sharing), else its own disjoint set."""

    threads: int
    cpus: Optional[list[int]]

    def describe(self, allowed: list[int]) -> str:
        where = f"pinned to CPUs {format_cpu_list(self.cpus)}" if self.cpus is not None \
            else f"sharing CPUs {format_cpu_list(allowed)}"
        return f"{self.threads} torch thread{'s' if self.threads != 1 else ''}, {where}"


def plan_member(member: int, members: int, pin: bool, cpus: Optional[list[int]] = None,
                cpu_limit: Optional[float] = None,
                siblings: Callable[[int], list[int]] = read_siblings) -> CpuPlan:
    """The share of member `member` of `members` (cluster servers or TP ranks) of `cpus`
    (default: this process's affinity) under a cgroup quota of cpu_limit CPUs."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = physical_cores(cpus, siblings)
    per_member_limit = None if cpu_limit is None else cpu_limit / members
    sets = split_cores(cores, members) if pin and members > 1 else None
    if sets is not None:
        mine = sets[member]
        return CpuPlan(compute_threads(len(physical_cores(mine, siblings)), per_member_limit), mine)
    return CpuPlan(compute_threads(len(cores) // members, per_member_limit), None)


def apply_plan(plan: CpuPlan) -> None:
    """Pins this process (already started threads keep their old mask: call it early)."""
    if plan.cpus is not None:
        os.sched_setaffinity(0, plan.cpus)
