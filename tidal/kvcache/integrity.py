"""Memory invariants of the KV cache, checked at page granularity.

Every usable page is exactly one of: free, in the prefix-cache tree, or held by a
live request (a live request's pages that are tree pages are the tree's: its
cached prefix is shared). Every req slot is free or live, never both. With a sliding-window
pool, every SWA page is free or mapped from exactly one full page (tidal/kvcache/swa.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from tidal.kvcache.allocator import PagedTokenAllocator
from tidal.kvcache.req_to_token_pool import ReqToTokenPool
from tidal.kvcache.swa import SWAPagedAllocator, check_swa

_SHOW = 8  # how many offending pages a message names


def check_integrity(
    req_to_token_pool: ReqToTokenPool,
    allocator: PagedTokenAllocator | SWAPagedAllocator,
    cache: Any,
    live: list[tuple[int, int]],
) -> None:
    """live: (req_pool_idx, kv_len) of each live request. Raises AssertionError."""
    errors = _check_req_slots(req_to_token_pool, live)
    errors += _check_pages(req_to_token_pool, allocator, cache, live)
    errors += _check_tree(cache, allocator.page_size)
    if isinstance(allocator, SWAPagedAllocator):
        errors += check_swa(allocator, cache)
    if errors:
        raise AssertionError("KV cache integrity check failed:\n  " + "\n  ".join(errors))


def _check_req_slots(pool: ReqToTokenPool, live: list[tuple[int, int]]) -> list[str]:
    errors = []
    free = pool.free_slots()
    live_idx = [idx for idx, _ in live]
    for name, slots in (("free", free), ("live", live_idx)):
        dup = sorted(i for i, k in Counter(slots).items() if k > 1)
        if dup:
            errors.append(f"req slots listed twice as {name}: {dup[:_SHOW]}")
        bad = [i for i in slots if not 0 <= i < pool.size]
        if bad:
            errors.append(f"{name} req slots out of range [0, {pool.size}): {bad[:_SHOW]}")
    both = sorted(set(free) & set(live_idx))
    if both:
        errors.append(f"{len(both)} req slots both free and live: {both[:_SHOW]}")
    lost = sorted(set(range(pool.size)) - set(free) - set(live_idx))
    if lost:
        errors.append(f"{len(lost)} req slots leaked (neither free nor live): {lost[:_SHOW]}")
    return errors


def _check_pages(
    pool: ReqToTokenPool, allocator: PagedTokenAllocator, cache: Any, live: list[tuple[int, int]]
) -> list[str]:
    ps = allocator.page_size
    errors: list[str] = []
    tree_slots = cache.all_slots().cpu()
    tree_pages = torch.unique(tree_slots // ps)
    if torch.unique(tree_slots).numel() != tree_slots.numel():
        errors.append(f"tree holds {tree_slots.numel() - torch.unique(tree_slots).numel()} slots twice")
    elif tree_slots.numel() != tree_pages.numel() * ps:
        errors.append(f"tree holds partial pages ({tree_slots.numel()} slots in {tree_pages.numel()} pages)")
    owners: list[tuple[str, torch.Tensor]] = [("free", allocator.free_pages().cpu()), ("tree", tree_pages)]
    for idx, kv_len in live:
        if not 0 <= kv_len <= pool.max_context_len:
            errors.append(f"req {idx}: kv_len {kv_len} outside [0, {pool.max_context_len}]")
            continue
        pages = torch.unique(pool.req_to_token[idx, :kv_len].cpu() // ps)
        owners.append((f"req {idx}", pages[~torch.isin(pages, tree_pages)]))
    return errors + _count_owners(owners, allocator.num_pages)


def _count_owners(owners: list[tuple[str, torch.Tensor]], num_pages: int) -> list[str]:
    errors: list[str] = []
    counts = torch.zeros(num_pages + 1, dtype=torch.int64)
    for name, pages in owners:
        outside = pages[(pages < 1) | (pages > num_pages)]
        if outside.numel():
            errors.append(f"{name} holds {outside.numel()} pages outside [1, {num_pages}]: {outside[:_SHOW].tolist()}")
        inside = pages[(pages >= 1) & (pages <= num_pages)]
        counts += torch.bincount(inside, minlength=num_pages + 1)
    lost = torch.nonzero(counts[1:] == 0).flatten() + 1
    if lost.numel():
        errors.append(
            f"{lost.numel()} pages leaked (not free, not in tree, not held by a live request): "
            f"{lost[:_SHOW].tolist()}"
        )
    double = torch.nonzero(counts[1:] > 1).flatten() + 1
    if double.numel():
        shown = "; ".join(_describe(int(p), owners) for p in double[:_SHOW])
        errors.append(f"{double.numel()} pages owned more than once: {shown}")
    return errors


def _describe(page: int, owners: list[tuple[str, torch.Tensor]]) -> str:
    held = []
    for name, pages in owners:
        k = int((pages == page).sum())
        if k:
            held.append(name if k == 1 else f"{name} x{k}")
    return f"page {page}: {', '.join(held)}"


def _check_tree(cache: Any, page_size: int) -> list[str]:
    errors: list[str] = []
    ev, pr, total = cache.evictable_size(), cache.protected_size(), cache.total_size()
    if ev < 0 or pr < 0 or ev + pr != total:
        errors.append(f"tree accounting: evictable {ev} + protected {pr} != total {total}")
    root = getattr(cache, "root_node", None)
    if root is None:
        return errors
    walk_ev = walk_pr = 0
    for node in _walk(root):
        where = f"node {node.id}"
        if node.lock_ref < 0:
            errors.append(f"{where}: negative lock_ref {node.lock_ref}")
        if node.parent is not root and node.lock_ref > node.parent.lock_ref:
            errors.append(f"{where}: lock_ref {node.lock_ref} above its parent's {node.parent.lock_ref}")
        if node.namespace is not None:  # a LoRA namespace's empty, always-locked head
            if node.key or node.parent is not root or node.lock_ref < 1:
                errors.append(f"{where}: namespace node with key {len(node.key)}, lock_ref {node.lock_ref}")
            continue
        if len(node.key) != node.value.numel() or len(node.key) % page_size or not node.key:
            errors.append(f"{where}: key of {len(node.key)} tokens, value of {node.value.numel()} slots")
        if node.lock_ref > 0:
            walk_pr += len(node.key)
        else:
            walk_ev += len(node.key)
    if (walk_ev, walk_pr) != (ev, pr):
        errors.append(f"tree accounting: walked evictable {walk_ev} protected {walk_pr}, recorded {ev} {pr}")
    return errors


def _walk(root: Any) -> Iterator[Any]:
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        for child in node.children.values():
            if child.parent is not node:
                raise AssertionError(f"KV cache integrity: node {child.id} has a stale parent pointer")
            stack.append(child)
        yield node
