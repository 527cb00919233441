"""Peak resident memory of servers while a benchmark runs beside them.

    python -m tidal.bench.rss --target tidal=PID --target vllm=PID --seconds 900 --output-file rss.json

Every --interval seconds it sums the RSS of each target's process and all its descendants (a
tidal server's API process and scheduler ranks; vLLM's API and engine core) and keeps the peak
and the last sample per target; it stops after --seconds, when every target has exited, or at
SIGTERM / Ctrl-C, and prints one JSON line per target (MiB). Shared pages (a model file mapped by two processes) count
once per process, as `ps` shows them.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Optional

import psutil


def tree_rss(pid: int) -> Optional[int]:
    """Bytes resident in pid and its descendants; None once pid is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.rss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", required=True, help="NAME=PID (repeatable)")
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--output-file", default=None)
    ns = p.parse_args(argv)
    targets = {name: int(pid) for name, _, pid in (t.partition("=") for t in ns.target)}
    peak = {name: 0 for name in targets}
    last: dict[str, Optional[int]] = {name: None for name in targets}
    end = time.monotonic() + ns.seconds
    stop = []  # SIGTERM (kill PID) ends the watch like Ctrl-C: the peaks so far are still reported
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while time.monotonic() < end and not stop:
        alive = False
        for name, pid in targets.items():
            rss = tree_rss(pid)
            if rss is not None:
                alive = True
                last[name] = rss
                peak[name] = max(peak[name], rss)
        if not alive:
            break
        try:
            time.sleep(ns.interval)
        except KeyboardInterrupt:
            break
    mib = 1 << 20
    rows = [{"target": n, "peak_rss_mib": round(peak[n] / mib, 1),
             "last_rss_mib": None if last[n] is None else round(last[n] / mib, 1)} for n in targets]
    for row in rows:
        print(json.dumps(row))
    if ns.output_file:
        with open(ns.output_file, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
