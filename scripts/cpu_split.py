"""CPU seconds spent by each kind of process between two snapshots (calibration runs:
what the simulator's step costs leave out).

    python3 scripts/cpu_split.py snapshot before.json
    python3 scripts/cpu_split.py diff before.json after.json
"""

from __future__ import annotations

import json
import sys

import psutil

KINDS = (("tidal.router", "router"), ("tidal.cli bench", "bench client"), ("tidal.cli cluster", "cluster parent"),
         ("tidal.launch_server", "server API process"))


def kind(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    if "multiprocessing" in cmd and any("tidal.launch_server" in " ".join(a.cmdline()) for a in p.parents()):
        return "server scheduler"
    return next((name for key, name in KINDS if key in cmd), "other")


def snapshot() -> dict[str, list]:
    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            out[str(p.pid)] = [kind(p), t.user + t.system]
        except psutil.Error:
            pass
    return out


def diff(before: dict, after: dict) -> dict[str, float]:
    by_kind: dict[str, float] = {}
    for pid, (k, cpu) in after.items():
        by_kind[k] = by_kind.get(k, 0.0) + cpu - (before.get(pid, [k, 0.0])[1])
    return {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    if sys.argv[1] == "snapshot":
        with open(sys.argv[2], "w") as f:
            json.dump(snapshot(), f)
    else:
        print(json.dumps(diff(*(json.load(open(p)) for p in sys.argv[2:4])), indent=1))
