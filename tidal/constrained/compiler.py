"""GrammarCompiler: the scheduler's grammar queue.

A request with a grammar waits here while a worker thread compiles it (llguidance builds its
parser with the GIL released), so the scheduler loop never blocks on a grammar; `take_ready`
hands back the requests whose matcher is ready (or whose grammar failed) once per iteration.
Compiled grammars are cached by (kind, text): a cache hit gives a fresh copy of the cached
matcher at once. The llguidance tokenizer (~0.4 s to build) is built on the worker at the
first grammar request, so servers that never see one never pay for it.

With tensor parallelism every rank holds its own queue and matchers; ranks agree (one small
all-gather per iteration while the queue is not empty) on which requests leave it, so every
rank admits the same requests at the same iteration.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from tidal.constrained.grammar import GrammarError, JsonStyle, to_llguidance

logger = logging.getLogger(__name__)

_PENDING, _READY, _EXPIRED = 0, 1, 2


class _Waiting:
    __slots__ = ("req", "key", "future", "deadline")

    def __init__(self, req: Any, key: tuple[str, str], future: Future, deadline: float):
        self.req, self.key, self.future, self.deadline = req, key, future, deadline

    def status(self, now: float) -> int:
        if self.future.done():
            return _READY
        return _EXPIRED if now >= self.deadline else _PENDING


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], tp: Any,
                 style: Optional[JsonStyle] = None, timeout_s: float = 60.0, cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.tp = tp
        self.style = style or JsonStyle()
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # key -> template LLMatcher
        self.waiting: list[_Waiting] = []
        self.num_compiled = 0
        self.num_cache_hits = 0
        self._lltok: Any = None
        self._pool: Optional[ThreadPoolExecutor] = None

    # ------------------------------------------------------------------ scheduler side

    def start(self, req: Any, key: tuple[str, str]) -> bool:
        """Give req its matcher now (True) or queue its compilation (False)."""
        template = self.cache.get(key)
        if template is not None:
            self.cache.move_to_end(key)
            self.num_cache_hits += 1
            req.grammar = template.deep_copy()
            return True
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-grammar")
        future = self._pool.submit(self._compile, key)
        self.waiting.append(_Waiting(req, key, future, time.monotonic() + self.timeout_s))
        return False

    def take_ready(self) -> list[tuple[Any, Optional[str]]]:
        """(request, error or None) for each request that leaves the queue this iteration."""
        if not self.waiting:
            return []
        now = time.monotonic()
        mine = [w.status(now) for w in self.waiting]
        everyone = self.tp.all_gather_ints(mine) if self.tp.size > 1 else [mine]
        agreed = [_agree([rank[i] for rank in everyone]) for i in range(len(mine))]
        out, keep = [], []
        for w, state in zip(self.waiting, agreed):
            if state == _PENDING:
                keep.append(w)
            elif state == _EXPIRED:
                out.append((w.req, f"compiling the grammar took longer than {self.timeout_s:g} s"))
            else:
                out.append((w.req, self._attach(w)))
        self.waiting = keep
        return out

    def drop(self, req: Any) -> bool:
        """Forget a queued request (aborted); True if it was queued."""
        n = len(self.waiting)
        self.waiting = [w for w in self.waiting if w.req is not req]
        return len(self.waiting) != n

    def wait_all(self, timeout_s: float) -> None:
        """Block until every queued compilation ends or timeout_s passes (before a role switch,
        so the queued requests join the old role's queues and move with them)."""
        deadline = time.monotonic() + timeout_s
        for w in self.waiting:
            try:
                w.future.exception(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                break

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _attach(self, w: _Waiting) -> Optional[str]:
        try:
            template = w.future.result()
        except GrammarError as e:
            return str(e)
        except Exception as e:  # a bug in the grammar engine must fail the request, not the loop
            logger.exception("grammar compilation failed")
            return f"grammar compilation failed: {e}"
        self.cache[w.key] = template
        self.cache.move_to_end(w.key)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        w.req.grammar = template.deep_copy()
        return None

    # ------------------------------------------------------------------ worker side

    def _compile(self, key: tuple[str, str]) -> Any:
        from llguidance import LLMatcher

        grammar = to_llguidance(key[0], key[1], self.style)
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {key[0]}: {matcher.get_error()}")
        self.num_compiled += 1
        return matcher

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance.hf

            t0 = time.monotonic()
            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids)
            logger.info("grammar tokenizer built in %.2f s", time.monotonic() - t0)
        return self._lltok


def _agree(states: list[int]) -> int:
    if all(s == _READY for s in states):
        return _READY
    return _EXPIRED if any(s == _EXPIRED for s in states) else _PENDING
