"""A benchmark's servers: a process started, awaited on its /health, and stopped."""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Iterator, Optional

import httpx


@contextlib.contextmanager
def serving(cmd: list[str], url: str, log_path: Optional[str] = None, timeout_s: float = 300) -> Iterator[str]:
    """Runs `cmd` (output to `log_path`, else dropped) until the block ends; yields `url` once its /health
    answers 200. Raises when the process exits or does not answer within `timeout_s`."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log_path, "w")) if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_healthy(url, proc, timeout_s)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become ready in {timeout_s:g}s")
