"""Where a scheduler iteration's wall time goes, logged at DEBUG level.

Phases: recv (read + handle API messages), schedule (role queues + next batch, with
its KV allocation and ForwardBatch tensors), forward (the model), sample, process
(result: stop checks, KV release, outputs queued), send (ZMQ to the API process).
Iterations that ran no batch are not counted.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

PHASES = ("recv", "schedule", "forward", "sample", "process", "send")
LOG_EVERY = 100  # busy iterations per debug line


class StepTiming:
    def __init__(self) -> None:
        self.enabled = logger.isEnabledFor(logging.DEBUG)
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.iterations = 0
        self.batch_sizes = 0
        self.current = dict.fromkeys(PHASES, 0.0)

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] += seconds

    def end_iteration(self, busy: bool, batch_size: int = 0) -> None:
        if busy:
            for k, v in self.current.items():
                self.totals[k] += v
            self.iterations += 1
            self.batch_sizes += batch_size
            if self.enabled and self.iterations >= LOG_EVERY:
                self._log()
        self.current = dict.fromkeys(PHASES, 0.0)

    def _log(self) -> None:
        n = self.iterations
        total = sum(self.totals.values())
        parts = " ".join(f"{k}={1000 * v / n:.2f}" for k, v in self.totals.items())
        non_forward = total - self.totals["forward"]
        logger.debug("step timing over %d busy iterations (mean batch %.1f), ms/iteration: %s total=%.2f "
                     "non-forward=%.2f (%.1f%%)", n, self.batch_sizes / n, parts, 1000 * total / n,
                     1000 * non_forward / n, 100 * non_forward / max(total, 1e-9))
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.iterations = 0
        self.batch_sizes = 0


now = time.perf_counter
