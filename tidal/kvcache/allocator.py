"""Paged KV slot allocator.

Slots are grouped in pages of `page_size` consecutive slots; page p holds slots
[p * page_size, (p + 1) * page_size). Page 0 is the dummy page of the KV pool and
is never handed out, so usable pages are 1..num_pages. The allocator owns whole
pages: a request's positions [k * page_size, (k + 1) * page_size) always live in
one page, at the same offsets, which is what lets a request continue in its
partial last page.

Free pages are an int64 tensor; allocation slices its head and freeing appends,
so both cost a few tensor ops whatever the number of tokens.
"""

from __future__ import annotations

import torch


class PagedTokenAllocator:
    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu", debug: bool = False):
        """size: usable tokens, rounded down to whole pages.

        debug: validate every free (range, double free). It syncs with the device,
        so it is meant for tests and `--enable-integrity-check`.
        """
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.debug = debug
        self._free_pages = torch.empty(0, dtype=torch.int64, device=self.device)
        self._group: list[torch.Tensor] | None = None
        self.clear()

    # ---- state ----------------------------------------------------------------

    def clear(self) -> None:
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._group = None

    def available_size(self) -> int:
        """Free tokens (whole free pages; the free room in requests' partial pages is not counted)."""
        return int(self._free_pages.numel()) * self.page_size

    def free_pages(self) -> torch.Tensor:
        """Every free page id, including frees pending in an open free group."""
        if self._group:
            return torch.cat([self._free_pages, *self._group])
        return self._free_pages.clone()

    # ---- allocation -------------------------------------------------------------

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > self._free_pages.numel():
            return None
        pages = self._free_pages[:n]
        self._free_pages = self._free_pages[n:]
        return pages

    def alloc(self, n: int) -> torch.Tensor | None:
        """n fresh slots. With page_size > 1 this takes ceil(n / page_size) whole pages
        and returns their first n slots (as for a request with no prefix); the caller
        owns the whole pages, including the unused room of the last one."""
        if n < 0:
            raise ValueError("alloc(n) needs n >= 0")
        if self.page_size == 1:
            return self._take_pages(n)
        return self.alloc_extend([0], [n], [-1])

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Slots of positions [prefix_len, seq_len) of each request, concatenated.

        last_loc is the slot of position prefix_len - 1 (or -1 when prefix_len is 0).
        A request whose prefix ends inside a page continues in that page (slots
        last_loc + 1, ...) before taking new pages. All or nothing.
        """
        ps = self.page_size
        if not (len(prefix_lens) == len(seq_lens) == len(last_locs)):
            raise ValueError("alloc_extend: prefix_lens, seq_lens and last_locs differ in length")
        for p, s, loc in zip(prefix_lens, seq_lens, last_locs):
            _check_request(p, s, loc, ps)
        total = sum(s - p for p, s in zip(prefix_lens, seq_lens))
        if ps == 1:
            return self._take_pages(total)
        # Requests' new pages: from the page after the one holding position p - 1.
        new_pages = [_ceil(s, ps) - _ceil(p, ps) for p, s in zip(prefix_lens, seq_lens)]
        pages = self._take_pages(sum(new_pages))
        if pages is None:
            return None
        return self._extend_slots(prefix_lens, seq_lens, last_locs, new_pages, pages, total)

    def _extend_slots(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_locs: list[int],
        new_pages: list[int],
        pages: torch.Tensor,
        total: int,
    ) -> torch.Tensor:
        ps, dev = self.page_size, self.device

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=dev)

        prefix, n_new, last = t(prefix_lens), t([s - p for p, s in zip(prefix_lens, seq_lens)]), t(last_locs)
        n_pages = t(new_pages)
        page_start = torch.cumsum(n_pages, 0) - n_pages  # [B] index of each request's first page in `pages`
        req = torch.repeat_interleave(torch.arange(len(prefix_lens), device=dev), n_new, output_size=total)
        out_start = torch.cumsum(n_new, 0) - n_new
        pos = torch.arange(total, device=dev) - out_start[req] + prefix[req]  # [total] token positions
        aligned = (prefix + ps - 1) // ps * ps  # first position that goes to a new page
        in_old_page = pos < aligned[req]
        slots = last[req] + 1 + (pos - prefix[req])
        if pages.numel() == 0:
            return slots
        page_slots = (pages[:, None] * ps + torch.arange(ps, device=dev)[None, :]).reshape(-1)  # [pages * ps]
        idx = page_start[req] * ps + (pos - aligned[req])
        idx = idx.clamp(0, page_slots.numel() - 1)  # rows still in their old page are masked below
        return torch.where(in_old_page, slots, page_slots[idx])

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for position seq_len - 1 (seq_lens include the new token)."""
        if len(seq_lens) != len(last_locs):
            raise ValueError("alloc_decode: seq_lens and last_locs differ in length")
        if self.page_size == 1:
            return self._take_pages(len(seq_lens))
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    # ---- freeing ---------------------------------------------------------------

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that hold `slots` (the caller owns those whole pages)."""
        if slots.numel() == 0:
            return
        pages = slots.reshape(-1).to(torch.int64)
        if self.page_size > 1:
            pages = torch.unique(pages // self.page_size)
        if self._group is not None:
            # page_size 1: `pages` may still be a view of req_to_token, which can change before the group ends
            self._group.append(pages.clone() if self.page_size == 1 else pages)
            return
        self._release(pages)

    def free_group_begin(self) -> None:
        if self._group is not None:
            raise RuntimeError("free group already open")
        self._group = []

    def free_group_end(self) -> None:
        if self._group is None:
            raise RuntimeError("free_group_end without free_group_begin")
        group, self._group = self._group, None
        if group:
            self._release(torch.cat(group))

    def _release(self, pages: torch.Tensor) -> None:
        if self.debug:
            self._check_free(pages)
        self._free_pages = torch.cat([self._free_pages, pages])

    def _check_free(self, pages: torch.Tensor) -> None:
        bad = pages[(pages < 1) | (pages > self.num_pages)]
        if bad.numel():
            raise RuntimeError(f"freeing pages outside [1, {self.num_pages}]: {bad[:8].tolist()}")
        uniq = torch.unique(pages)
        if uniq.numel() != pages.numel():
            raise RuntimeError(f"freeing {pages.numel() - uniq.numel()} page(s) twice in one call")
        again = uniq[torch.isin(uniq, self._free_pages)]
        if again.numel():
            raise RuntimeError(f"double free of {again.numel()} page(s): {again[:8].tolist()}")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check_request(prefix_len: int, seq_len: int, last_loc: int, page_size: int) -> None:
    if not 0 <= prefix_len <= seq_len:
        raise ValueError(f"bad extend: prefix_len={prefix_len} seq_len={seq_len}")
    off = prefix_len % page_size
    if off == 0:
        return
    # The partial page must be at the same offset as the position inside its page.
    if last_loc < page_size or (last_loc + 1) % page_size != off:
        raise ValueError(
            f"last_loc={last_loc} does not end position {prefix_len - 1} of a page of size {page_size}"
        )
