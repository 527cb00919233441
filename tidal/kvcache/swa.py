"""The sliding-window (SWA) side of the KV cache: a second, smaller page pool for windowed layers.

A model with sliding-window layers (tidal/model/config.py `layer_windows`) reads, in those layers,
only the last W positions of a request. Their KV lives in buffers of their own (the KV pool's
`swa_layers`), paged like the full-attention layers' but with fewer pages: a full page p of the
main allocator holds, in the windowed layers, SWA page `page_map[p]` (0: none, the position's
windowed KV is gone). Slot offsets inside a page are the same in both, so a full slot s is the SWA
slot `page_map[s // ps] * ps + s % ps`; a dead page maps to the dummy page 0, which attention
masks anyway.

Lifetimes: a full page and its SWA page are taken together and freed together (eviction,
release), and the SWA page alone can go earlier: once every position of the page is out of the
window of every query still to come (`free_swa`, see KVMemory.free_out_of_window). A request only
frees SWA pages of positions it alone holds (computed by it and not yet in the prefix tree), so a
tree page's SWA page lives as long as the tree page; the tree instead stops a prefix match where
the last W positions no longer all have one (RadixCache.match_prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.kvcache.allocator import PagedTokenAllocator


def swa_slots(page_map: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The SWA slot of each full slot (a dead one -> its offset in the dummy page 0)."""
    return page_map[slots // page_size] * page_size + slots % page_size


@dataclass(frozen=True)
class SWALayout:
    """What the scheduler's allocator needs of a KV pool with windowed buffers."""
    window: int  # the largest window of the model's layers
    size: int  # usable slots of the windowed buffers
    page_map: torch.Tensor  # the pool's swa_page_map


class SWAPagedAllocator:
    """PagedTokenAllocator's interface over two allocators: `full` (what slots and req_to_token mean)
    and `swa` (the windowed layers' pages), kept in step through `page_map`.

    page_map: the KV pool's [full pages + 1] int64 map, written here and read by attention backends.
    window: the largest window of the model's layers (what a query may look back).
    """

    def __init__(self, size: int, swa_size: int, page_size: int, window: int, page_map: torch.Tensor,
                 device: str | torch.device = "cpu", debug: bool = False):
        self.full = PagedTokenAllocator(size, page_size, device, debug=debug)
        self.swa = PagedTokenAllocator(swa_size, page_size, device, debug=debug)
        if page_map.numel() != self.full.num_pages + 1:
            raise ValueError(f"page_map has {page_map.numel()} entries for {self.full.num_pages} full pages")
        self.page_map = page_map
        self.window = window
        self.page_size, self.num_pages, self.size = page_size, self.full.num_pages, self.full.size
        self.device, self.debug = self.full.device, debug
        self.page_map.zero_()

    # ---- state ----------------------------------------------------------------

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.page_map.zero_()

    def available_size(self) -> int:
        """Free tokens of the full pool (the SWA pool's: `swa_available_size`)."""
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def free_pages(self) -> torch.Tensor:
        return self.full.free_pages()

    def alive(self, slots: torch.Tensor) -> torch.Tensor:
        """bool per full slot: its windowed layers' KV is still held."""
        return self.page_map[slots // self.page_size] != 0

    def swa_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return swa_slots(self.page_map, slots, self.page_size)

    # ---- allocation -------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        if n < 0:
            raise ValueError("alloc(n) needs n >= 0")
        return self.alloc_extend([0], [n], [-1])

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        return self._mapped(self.full.alloc_extend(prefix_lens, seq_lens, last_locs))

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        return self._mapped(self.full.alloc_decode(seq_lens, last_locs))

    def _mapped(self, slots: torch.Tensor | None) -> torch.Tensor | None:
        """Give the new full pages among `slots` SWA pages; all or nothing."""
        if slots is None or slots.numel() == 0:
            return slots
        ps = self.page_size
        pages = slots // ps if ps == 1 else torch.unique(slots // ps)
        new = pages[self.page_map[pages] == 0]  # a request's partial last page is mapped already
        swa_pages = self.swa._take_pages(int(new.numel()))
        if swa_pages is None:
            self.full.free(new * ps)
            return None
        self.page_map[new] = swa_pages
        return slots

    # ---- freeing ---------------------------------------------------------------

    def free(self, slots: torch.Tensor) -> None:
        """Free the full pages holding `slots` and their SWA pages."""
        if slots.numel() == 0:
            return
        self.free_swa(slots)
        self.full.free(slots)

    def free_swa(self, slots: torch.Tensor) -> None:
        """Free only the SWA pages of the full pages holding `slots` (those that have one)."""
        if slots.numel() == 0:
            return
        ps = self.page_size
        pages = slots.reshape(-1) // ps
        if ps > 1:
            pages = torch.unique(pages)
        swa_pages = self.page_map[pages]
        swa_pages = swa_pages[swa_pages != 0]
        if swa_pages.numel():
            self.page_map[pages] = 0
            self.swa.free(swa_pages * ps)

    def free_group_begin(self) -> None:
        self.full.free_group_begin()
        self.swa.free_group_begin()

    def free_group_end(self) -> None:
        self.full.free_group_end()
        self.swa.free_group_end()


def check_swa(allocator: SWAPagedAllocator, cache) -> list[str]:
    """The SWA pool's invariants: every SWA page is free or mapped from exactly one full page, no
    free full page is mapped, and the tree's count of SWA tokens matches its pages."""
    errors: list[str] = []
    page_map = allocator.page_map.cpu()
    mapped = page_map[1:][page_map[1:] != 0]
    free_swa = allocator.swa.free_pages().cpu()
    counts = torch.bincount(torch.cat([mapped, free_swa]), minlength=allocator.swa.num_pages + 1)[1:]
    if counts.numel() > allocator.swa.num_pages:
        errors.append(f"SWA pages outside [1, {allocator.swa.num_pages}]")
    lost = torch.nonzero(counts == 0).flatten() + 1
    if lost.numel():
        errors.append(f"{lost.numel()} SWA pages leaked (neither free nor mapped): {lost[:8].tolist()}")
    double = torch.nonzero(counts > 1).flatten() + 1
    if double.numel():
        errors.append(f"{double.numel()} SWA pages mapped or freed more than once: {double[:8].tolist()}")
    free_full = allocator.full.free_pages().cpu()
    stale = free_full[page_map[free_full] != 0]
    if stale.numel():
        errors.append(f"{stale.numel()} free full pages still map an SWA page: {stale[:8].tolist()}")
    return errors + _check_tree_swa(allocator, cache)


def _check_tree_swa(allocator: SWAPagedAllocator, cache) -> list[str]:
    nodes = list(getattr(cache, "_nodes", lambda: [])())
    if not nodes:
        return []
    errors: list[str] = []
    walked = {True: 0, False: 0}
    for node in nodes:
        alive = int(allocator.alive(node.value).sum()) if node.value.numel() else 0
        if alive != node.swa_len:
            errors.append(f"node {node.id}: {alive} tokens with SWA pages, recorded {node.swa_len}")
        walked[node.lock_ref > 0] += node.swa_len
    recorded = (cache.swa_evictable_size(), cache.swa_protected_size())
    if (walked[False], walked[True]) != recorded:
        errors.append(f"tree SWA accounting: walked evictable {walked[False]} protected {walked[True]}, "
                      f"recorded {recorded[0]} {recorded[1]}")
    return errors


def swa_valid_len(alive: torch.Tensor, window: int, page_size: int) -> int:
    """The longest page-aligned prefix length L of a match whose positions a query at L sees,
    (L - window, L), all still have windowed KV (`alive`: bool per matched position)."""
    n = alive.numel()
    if n == 0 or bool(alive[max(0, n - window + 1):].all()):
        return n
    idx = torch.arange(n, device=alive.device)
    last_dead = torch.cummax(torch.where(alive, -1, idx), dim=0).values  # [n]: last dead position <= i
    ends = torch.arange(page_size, n + 1, page_size, device=alive.device)  # candidate L
    ok = last_dead[ends - 1] <= ends - window
    good = ends[ok]
    return int(good[-1]) if good.numel() else 0
