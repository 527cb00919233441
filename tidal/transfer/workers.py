"""Transfer worker threads of a prefill manager: jobs of one room always run on the
same worker, in the order they were queued."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class TransferWorkers:
    def __init__(self, num: int, name: str, on_exit: Callable[[], None]):
        self._queues: list[queue.SimpleQueue[Optional[Job]]] = [queue.SimpleQueue() for _ in range(num)]
        self._on_exit = on_exit
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"tidal-kv-xfer-{name}-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    def submit(self, room: int, job: Job) -> None:
        self._queues[room % len(self._queues)].put(job)

    def broadcast(self, job: Job) -> None:
        """Runs job once in every worker thread (per-thread resources)."""
        for q in self._queues:
            q.put(job)

    def close(self) -> None:
        """Runs what is queued, then stops every worker."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()

    def _run(self, q: "queue.SimpleQueue[Optional[Job]]") -> None:
        try:
            while True:
                job = q.get()
                if job is None:
                    return
                try:
                    job()
                except Exception:
                    logger.exception("transfer job failed")
        finally:
            try:
                self._on_exit()
            except Exception:
                logger.exception("transfer worker cleanup failed")
