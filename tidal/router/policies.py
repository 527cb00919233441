"""Load-balancing policies: pick one worker out of a pool's healthy candidates.

Each pool (prefill, decode, whole-request) gets its own policy instance, so
round-robin counters and the cache-aware prefix index are per pool.
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict
from typing import Callable, Mapping, Optional, Sequence

from tidal.router.workers import DECODE, NULL, PREFILL, Worker, WorkerRegistry

POLICIES = ("random", "round_robin", "power_of_two", "cache_aware", "kv_aware")


@dataclasses.dataclass(frozen=True)
class PromptTokens:
    """A prompt as a worker's prefix cache keys it: token ids within a namespace (a LoRA adapter; None: base)."""

    ids: Sequence[int]
    namespace: Optional[str] = None


class Policy:
    name = "base"
    wants_tokens = False  # True: the dispatcher passes the prompt's PromptTokens (kv_aware)

    def select(self, workers: Sequence[Worker], text: str = "", tokens: Optional[PromptTokens] = None) -> Worker:
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """A worker left the registry."""

    def stats(self) -> Optional[dict]:
        """The policy's own counters for GET /workers (None: it keeps none)."""
        return None


def least_loaded(workers: Sequence[Worker]) -> Worker:
    return min(workers, key=lambda w: (w.load_score(), w.load.get("num_tokens", 0) if w.load else 0))


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: Optional[int] = None) -> None:
        self.rng = random.Random(seed)

    def select(self, workers: Sequence[Worker], text: str = "", tokens: Optional[PromptTokens] = None) -> Worker:
        return self.rng.choice(list(workers))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.counter = 0

    def select(self, workers: Sequence[Worker], text: str = "", tokens: Optional[PromptTokens] = None) -> Worker:
        ordered = sorted(workers, key=lambda w: w.url)
        w = ordered[self.counter % len(ordered)]
        self.counter += 1
        return w


class PowerOfTwoPolicy(Policy):
    """Sample two distinct workers, keep the one with the lower load score."""

    name = "power_of_two"

    def __init__(self, seed: Optional[int] = None) -> None:
        self.rng = random.Random(seed)

    def select(self, workers: Sequence[Worker], text: str = "", tokens: Optional[PromptTokens] = None) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(list(workers), 2)
        return b if b.load_score() < a.load_score() else a


class PrefixIndex:
    """An approximate radix tree over request text.

    The text is cut into fixed-size character blocks; block i is keyed by a hash
    chained over blocks 0..i, so a key stands for a whole prefix. Each key maps to the
    workers that were sent a text with that prefix. Keys are kept in LRU order and the
    oldest are evicted beyond `max_entries`, which bounds memory.
    """

    def __init__(self, block_chars: int = 16, max_entries: int = 1 << 17) -> None:
        self.block_chars = max(1, block_chars)
        self.max_entries = max(1, max_entries)
        self._map: OrderedDict[int, set[str]] = OrderedDict()
        self.sizes: dict[str, int] = {}  # url -> number of keys it holds

    def __len__(self) -> int:
        return len(self._map)

    def _keys(self, text: str) -> list[tuple[int, int]]:
        """(key, prefix length in chars) per block; a short tail is its own last block."""
        out, h, n = [], 0, self.block_chars
        for start in range(0, len(text), n):
            block = text[start:start + n]
            h = hash((h, block))
            out.append((h, start + len(block)))
        return out

    def match(self, text: str, candidates: set[str]) -> tuple[set[str], int]:
        """The candidates holding the longest cached prefix of `text`, and its length."""
        best: set[str] = set()
        length = 0
        for key, end in self._keys(text):
            owners = self._map.get(key)
            hit = owners & candidates if owners else set()
            if not hit:
                break
            self._map.move_to_end(key)
            best, length = hit, end
        return best, length

    def insert(self, text: str, url: str) -> None:
        for key, _ in self._keys(text):
            owners = self._map.setdefault(key, set())
            if url not in owners:
                owners.add(url)
                self.sizes[url] = self.sizes.get(url, 0) + 1
            self._map.move_to_end(key)
        while len(self._map) > self.max_entries:
            _, evicted = self._map.popitem(last=False)
            for u in evicted:
                self.sizes[u] -= 1

    def forget(self, url: str) -> None:
        for key in [k for k, owners in self._map.items() if url in owners]:
            owners = self._map[key]
            owners.discard(url)
            if not owners:
                del self._map[key]
        self.sizes.pop(url, None)


class CacheAwarePolicy(Policy):
    """Prefix affinity, unless the pool's load is too imbalanced.

    Imbalanced means `max - min > balance_abs_threshold` and
    `max > min * balance_rel_threshold` (load scores); then the least-loaded worker
    wins. Otherwise the worker holding the longest cached prefix wins when that
    prefix covers at least `cache_threshold` of the text; on a miss the least-loaded
    worker wins, ties going to the one holding the fewest cached prefixes, which
    spreads new prefixes over the pool. The chosen worker is recorded as holding the
    text either way.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: float = 32,
                 balance_rel_threshold: float = 1.5, max_entries: int = 1 << 17, block_chars: int = 16) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(block_chars, max_entries)

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.load_score() for w in workers]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def select(self, workers: Sequence[Worker], text: str = "", tokens: Optional[PromptTokens] = None) -> Worker:
        chosen: Optional[Worker] = None
        if len(workers) > 1 and not self.imbalanced(workers) and text:
            owners, matched = self.index.match(text, {w.url for w in workers})
            if owners and matched >= self.cache_threshold * len(text):
                chosen = least_loaded([w for w in workers if w.url in owners])
        if chosen is None:
            sizes = self.index.sizes
            chosen = min(workers, key=lambda w: (w.load_score(), sizes.get(w.url, 0)))
        if text:
            self.index.insert(text, chosen.url)
        return chosen

    def forget(self, url: str) -> None:
        self.index.forget(url)


def make_policy(name: str, cache_threshold: float = 0.5, balance_abs_threshold: float = 32,
                balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 17, kv_follower=None,
                kv_load_weight: float = 1.0) -> Policy:
    if name == "random":
        return RandomPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size)
    if name == "kv_aware":
        from tidal.router.kv_aware import KVAwarePolicy

        fallback = CacheAwarePolicy(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size)
        return KVAwarePolicy(kv_follower, fallback, kv_load_weight)
    raise ValueError(f"unknown policy {name!r}: expected one of {', '.join(POLICIES)}")


def pick(policies: Mapping[str, Policy], pool: list[Worker], role: str, text: str, tried: set[str],
         tokens: Optional[PromptTokens] = None) -> Worker:
    """The pool's policy over the workers not tried yet (all of them once every one was)."""
    fresh = [w for w in pool if w.url not in tried]
    return policies[role].select(fresh or pool, text, tokens)


def plan_route(registry: WorkerRegistry, policies: Mapping[str, Policy], text: str, tried: set[str],
               enforce_disaggregation: bool = False, admit: Optional[Callable[[Worker], bool]] = None,
               tokens: Optional[PromptTokens] = None) -> Optional[tuple[str, Worker, Optional[Worker]]]:
    """Where one request goes: ("pd", prefill, decode) or ("whole", worker, None); None when nothing
    can serve. With both paths open it joins the shorter queue (decode vs null load scores), ties
    to the whole path (no transfer). `admit` filters the pools (the router's circuit breakers). The
    router's dispatcher and `tidal sim` call it."""
    prefills, decodes, nulls = (
        [w for w in registry.pool(mode) if admit is None or admit(w)] for mode in (PREFILL, DECODE, NULL))
    if enforce_disaggregation:
        nulls = []
    pd_ok = bool(prefills and decodes)  # any TP sizes pair: the transfer slices KV heads (tidal.transfer.heads)
    if nulls and pd_ok:
        pd_ok = min(w.load_score() for w in nulls) > min(w.load_score() for w in decodes)
    if pd_ok:
        p = pick(policies, prefills, PREFILL, text, tried, tokens)
        return "pd", p, pick(policies, decodes, DECODE, text, tried, tokens)
    if nulls:
        return "whole", pick(policies, nulls, NULL, text, tried, tokens), None
    if decodes and not prefills and not enforce_disaggregation:
        return "whole", pick(policies, decodes, DECODE, text, tried, tokens), None  # decode prefills locally
    return None
