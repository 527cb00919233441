"""Waiting-queue ordering (SchedulePolicy) and prefill budgeting (PrefillAdder)."""

from __future__ import annotations

import enum
import random
from collections import defaultdict
from typing import Any, Callable, Optional

from tidal.scheduler.req import Req

# Decode tokens reserved per request are clipped so a huge max_new_tokens does not
# starve admission; retraction covers the rare request that really runs that long.
CLIP_MAX_NEW_TOKENS = 4096
# lpm / dfs-weight cost a prefix match per waiting request; past this queue length
# they fall back to fcfs so scheduling stays O(1) per request.
PREFIX_POLICY_MAX_QUEUE = 128


def request_slots(max_running_requests: int) -> int:
    """Rows of a server's request-to-token table: the running batch's, and a second set for requests that hold
    KV outside it (a decode server's pre-allocated ones, a prefill server's sending theirs)."""
    return 2 * max_running_requests + 8


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: Any, seed: int = 0):
        self.policy = policy
        self.tree_cache = tree_cache
        self._rng = random.Random(seed)

    def calc_priority(self, queue: list[Req]) -> None:
        """Reorder `queue` in place; prefix-aware policies also match prefixes."""
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (
            len(queue) > PREFIX_POLICY_MAX_QUEUE or getattr(self.tree_cache, "disabled", False)
        ):
            policy = "fcfs"
        if policy == "fcfs":
            return
        if policy == "lof":
            queue.sort(key=lambda r: -r.sampling.max_new_tokens)
        elif policy == "random":
            self._rng.shuffle(queue)
        elif policy == "lpm":
            for r in queue:
                match_prefix_for(r, self.tree_cache)
            queue.sort(key=lambda r: -len(r.prefix_indices))
        elif policy == "dfs-weight":
            for r in queue:
                match_prefix_for(r, self.tree_cache)
            self._sort_by_dfs_weight(queue)

    def _sort_by_dfs_weight(self, queue: list[Req]) -> None:
        """Visit the tree depth-first, heaviest subtree (most waiting requests) first."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, Any] = {}
        for r in queue:
            by_node[id(r.last_node)].append(r)
            nodes[id(r.last_node)] = r.last_node
        weight: dict[int, int] = defaultdict(int)
        for key, reqs in by_node.items():
            node = nodes[key]
            while node is not None:
                weight[id(node)] += len(reqs)
                node = getattr(node, "parent", None)
        ordered: list[Req] = []
        self._dfs(self.tree_cache.root_node, weight, by_node, ordered)
        seen = {id(r) for r in ordered}
        ordered += [r for r in queue if id(r) not in seen]
        queue[:] = ordered

    def _dfs(self, root: Any, weight: dict, by_node: dict, out: list[Req]) -> None:
        stack = [root]
        while stack:
            node = stack.pop()
            out.extend(by_node.get(id(node), []))
            children = [c for c in getattr(node, "children", {}).values() if weight.get(id(c), 0) > 0]
            children.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend(children)


def match_prefix_for(req: Req, tree_cache: Any) -> None:
    """Set req.prefix_indices / last_node from the cache (before the request holds a lock)."""
    req.fill_ids = req.all_ids
    key = req.fill_ids[: req.prefix_match_limit()]
    result = tree_cache.match_prefix(key, req.lora_name)
    req.prefix_indices = result.device_indices
    req.last_node = result.last_node
    req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)


class AddResult(enum.Enum):
    CONTINUE = 0  # added, try the next request
    NO_TOKEN = 1  # out of KV memory
    OTHER = 2  # out of this round's input/chunk budget


class PrefillAdder:
    """Chooses the next prefill batch under three token budgets.

    rem_total: KV tokens left (free + evictable) after reserving decode room for
        running requests (scaled by new_token_ratio) and for requests added here;
    rem_input: prompt tokens this round may compute (--max-prefill-tokens);
    rem_chunk: tokens one chunk may compute (--chunked-prefill-size), or None.
    """

    def __init__(
        self,
        tree_cache: Any,
        allocator: Any,
        running_reqs: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: Optional[int],
        page_size: int,
    ):
        # with nothing running, the first request may overcommit its decode room:
        # retraction handles the shortfall, and otherwise it could never start
        self.overcommit_first = not running_reqs
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.new_token_ratio = new_token_ratio
        reserved = sum(r.reserved_decode_tokens(CLIP_MAX_NEW_TOKENS) for r in running_reqs)
        self.rem_total_tokens = (
            allocator.available_size() + tree_cache.evictable_size() - int(reserved * new_token_ratio)
        )
        # a sliding-window model's SWA pool is a second budget: a request's decode room there is at
        # most its window (it frees its pages past the window as it goes)
        self.rem_swa_tokens: Optional[int] = None
        self.swa_window: Optional[int] = getattr(allocator, "window", None)
        if self.swa_window is not None:
            swa_reserved = sum(self._swa_reserve(r.reserved_decode_tokens(CLIP_MAX_NEW_TOKENS)) for r in running_reqs)
            self.rem_swa_tokens = allocator.swa_available_size() + tree_cache.swa_evictable_size() - swa_reserved
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Optional[Req] = None

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def room(self) -> int:
        """KV tokens left in the tighter pool."""
        return self.rem_total_tokens if self.rem_swa_tokens is None else min(self.rem_total_tokens,
                                                                              self.rem_swa_tokens)

    def _fits(self, input_tokens: int, reserve: int) -> bool:
        if input_tokens + reserve >= self.rem_total_tokens:
            return False
        if self.rem_swa_tokens is None:
            return True
        # there a chunked prompt holds its chunk and a window at a time
        swa_input = input_tokens if self.rem_chunk_tokens is None else min(
            input_tokens, self.rem_chunk_tokens + self.swa_window + self.page_size)
        return swa_input + min(reserve, self.swa_window + self.page_size) < self.rem_swa_tokens

    def _evictable(self) -> tuple[int, int]:
        swa = self.tree_cache.swa_evictable_size() if self.rem_swa_tokens is not None else 0
        return self.tree_cache.evictable_size(), swa

    def _charge(self, tokens: int, swa_tokens: int) -> None:
        self.rem_total_tokens -= tokens
        if self.rem_swa_tokens is not None:
            self.rem_swa_tokens -= swa_tokens

    def budget_exhausted(self) -> bool:
        return (
            self.room() <= 0
            or self.rem_input_tokens <= 0
            or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0)
        )

    def _swa_reserve(self, reserve: int) -> int:
        return min(int(reserve * self.new_token_ratio), self.swa_window + self.page_size)

    def _take(self, extend: int, reserve: int) -> None:
        tokens = self._ceil_page(extend)
        swa = tokens + self._swa_reserve(reserve) if self.swa_window is not None else 0
        self._charge(tokens + int(reserve * self.new_token_ratio), swa)
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend

    def add_chunked_req(self, req: Req) -> None:
        """Continue the request whose previous chunk just finished."""
        req.init_next_round_input()
        self._add_maybe_truncated(req)

    def add_one_req(self, req: Req) -> AddResult:
        reserve = req.reserved_decode_tokens(CLIP_MAX_NEW_TOKENS)
        input_tokens = self._ceil_page(req.extend_input_len)
        if self.overcommit_first and not self.can_run_list:
            reserve = 0
        if not self._fits(input_tokens, reserve):
            return AddResult.NO_TOKEN
        if input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddResult.OTHER
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens < self.page_size:
            return AddResult.OTHER
        # locking the prefix makes it unevictable: it no longer counts as free room
        before = self._evictable()
        self.tree_cache.inc_lock_ref(req.last_node)
        after = self._evictable()
        self._charge(before[0] - after[0], before[1] - after[1])
        if not self._fits(input_tokens, reserve):
            self.tree_cache.dec_lock_ref(req.last_node)
            self._charge(after[0] - before[0], after[1] - before[1])
            return AddResult.NO_TOKEN
        self._add_maybe_truncated(req)
        return AddResult.OTHER if self.budget_exhausted() else AddResult.CONTINUE

    def _add_maybe_truncated(self, req: Req) -> None:
        fits = self.rem_chunk_tokens is None or req.extend_input_len <= self.rem_chunk_tokens
        if fits:
            self.can_run_list.append(req)
            self._take(req.extend_input_len, req.reserved_decode_tokens(CLIP_MAX_NEW_TOKENS))
            return
        trunc = self.rem_chunk_tokens // self.page_size * self.page_size
        trunc = max(trunc, 1)
        req.extend_input_len = trunc
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + trunc]
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self._take(trunc, 0)


def admit_waiting(adder: PrefillAdder, waiting: list, running_bs: int, max_running_requests: int,
                  free_slots: int, match: Callable[[Any], None],
                  decodes_here: Optional[Callable[[Any], bool]] = None) -> None:
    """Fill `adder` from the waiting queue, in order, until a budget stops it.

    Stops at the first request that does not fit (no skipping ahead), once a chunked request
    was started, at `max_running_requests` (running plus admitted), or when the new requests
    would take more than `free_slots` request slots. `match` sets a request's cached prefix
    before it is tried. Pure over its arguments: the live scheduler and `tidal sim` call it.

    `decodes_here` (None: every request): whether a request joins the running batch once
    prefilled. One that does not (a PD prompt on a prefill server) takes no running slot, only
    a place in the batch (at most `max_running_requests`); one that does waits while the
    running batch is full, and such a request behind it goes ahead.
    """
    joining = sum(1 for r in adder.can_run_list if decodes_here is None or decodes_here(r))
    for req in waiting:
        if adder.new_chunked_req is not None:
            break
        n_new = sum(1 for r in adder.can_run_list if r.req_pool_idx is None)
        if len(adder.can_run_list) >= max_running_requests or n_new >= free_slots:
            break
        joins = decodes_here is None or decodes_here(req)
        if joins and running_bs + joining >= max_running_requests:
            if decodes_here is None:
                break
            continue
        match(req)
        if adder.add_one_req(req) != AddResult.CONTINUE:
            break
        joining += joins
