"""`python -m tidal.bench.rss`: the peak RSS of a process tree, reported when stopped early too."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time


def test_rss_watch_stopped_by_sigterm_still_reports_the_peak():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = subprocess.Popen([sys.executable, "-m", "tidal.bench.rss", "--target", f"sleeper={sleeper.pid}",
                              "--seconds", "60", "--interval", "0.1"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(3)  # python's start-up, then a few samples
        watch.send_signal(signal.SIGTERM)
        out, _ = watch.communicate(timeout=30)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
        if watch.poll() is None:
            watch.kill()
    row = json.loads(out.strip().splitlines()[-1])
    assert row["target"] == "sleeper" and row["peak_rss_mib"] > 1
