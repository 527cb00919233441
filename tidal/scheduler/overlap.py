"""Overlap scheduling: decode step N+1's forward pass runs in a worker thread while the
scheduler thread processes step N's result and prepares what comes next.

torch releases the GIL inside its ops, so the scheduler's Python work (stop checks,
outputs to the API process, receiving requests, building the next batch) runs beside the
pass instead of between passes. Only decode steps overlap; a request's next input is the
token the in-flight pass samples for it, read by the worker when the pass it depends on
has ended (passes run one at a time, in submission order).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tidal.scheduler.schedule_batch import ScheduleBatch

# stands for the output token a request's in-flight pass has not sampled yet: only the
# number of output tokens (seeded draws, min_new_tokens) may depend on it, never its value
PENDING = [-1]


@dataclass
class InFlight:
    batch: ScheduleBatch
    future: Future  # (logits, SampleOutput)

    def __post_init__(self) -> None:
        self._ids = {id(r) for r in self.batch.reqs}

    def holds(self, req) -> bool:
        return id(req) in self._ids


class ForwardThread:
    """Runs jobs one at a time, in submission order, in one daemon thread started on first use."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], object]) -> Future:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tidal-forward", daemon=True)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if job is None:
                return
            try:
                future.set_result(job())
            except BaseException as e:  # the scheduler thread re-raises it where it waits
                future.set_exception(e)

    def stop(self) -> None:
        """The thread ends after the job it runs, if any; not waited for (SIGTERM exits at once,
        and the KV buffers a pass writes stay mapped until the process ends)."""
        if self._thread is not None:
            self._jobs.put((None, None))
            self._thread = None


def input_ids_from(prev: Optional[InFlight], batch: ScheduleBatch) -> Optional[Callable[[], None]]:
    """What the worker must do before `batch`'s pass so that each request that is in `prev`
    gets the token `prev` sampled for it as its input (None: every input is already known)."""
    if prev is None:
        return None
    row_of = {id(r): i for i, r in enumerate(prev.batch.reqs)}
    rows = [row_of.get(id(r), -1) for r in batch.reqs]
    if all(i < 0 for i in rows):
        return None
    fb = batch.forward_batch
    src = torch.tensor(rows, dtype=torch.int64, device=fb.input_ids.device)
    known = src < 0

    def resolve() -> None:
        sampled = prev.future.result()[1].next_token_ids  # done: passes run in order
        fb.input_ids = torch.where(known, fb.input_ids, sampled[src.clamp(min=0)])

    return resolve
