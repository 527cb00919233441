"""Radix-tree prefix cache over token ids, holding the KV slots of shared prefixes.

Each edge is a run of token ids (`node.key`) with the KV slots of those tokens
(`node.value`). With page_size > 1 only whole pages are matched or inserted, so
every node's key length is a multiple of page_size and its slots are whole pages.

Namespaces (LoRA): KV computed under a LoRA adapter is only valid for that adapter, so
each adapter's prefixes live under their own namespace node, a child of the root with an
empty key that is never evicted (it stays locked). Base-model prefixes hang off the root
itself, as without LoRA. A match never crosses namespaces.

Ownership: slots in the tree belong to the tree. A request that matched a prefix
locks the path (`inc_lock_ref`), which keeps it from eviction; `evictable_size`
counts tokens of unlocked nodes and `protected_size` of locked ones.

Sliding-window models (an SWAPagedAllocator, tidal/kvcache/swa.py): each node also counts its
tokens that still have windowed-layer KV (`swa_len`), summed like the sizes above
(`swa_evictable_size`); a match stops where the positions a query at its end sees are no longer
all there. A node's SWA pages go before the node only through `free_window` (a request that alone
holds it gives back a window it left at a chunk boundary), and come back through an insert (revive).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tidal.kvcache.allocator import PagedTokenAllocator
from tidal.kvcache.req_to_token_pool import ReqToTokenPool
from tidal.kvcache.swa import SWAPagedAllocator, swa_valid_len
from tidal.kvevents.events import block_hashes


class TreeNode:
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, time: int):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = time
        self.id = next(TreeNode._ids)
        self.namespace: Any = None  # set on a namespace node (an empty-keyed child of the root)
        self.hashes: list[int] = []  # with KV events: one chained hash per page of `key`
        self.swa_len = 0  # tokens of `value` with an SWA page (sliding-window models)

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # [matched_len] int64 KV slots of the matched prefix
    last_node: TreeNode  # deepest matched node; lock it to keep the prefix


class RadixCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: PagedTokenAllocator,
        page_size: int,
        disable: bool = False,
        events: Any = None,
    ):
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.device = allocator.device
        self._clock = itertools.count(1)
        self._protected = 0
        self.events = events  # a KVEventSink (tidal.kvevents.events): told of every page stored and removed
        self.swa = allocator if isinstance(allocator, SWAPagedAllocator) else None
        self._new_tree()

    # ---- tree state -------------------------------------------------------------

    def reset(self) -> bool:
        """Drop the tree without freeing its slots (the caller clears the allocator too).
        Refused (False) while any node is locked."""
        if self._protected > 0:
            return False
        if self.events is not None:
            self.events.cleared()
        self._new_tree()
        return True

    def _new_tree(self) -> None:
        self.root_node = TreeNode([], self._empty(), None, 0)
        self.root_node.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._swa_evictable = 0
        self._swa_protected = 0

    def flush(self) -> bool:
        """Free every slot of the tree and empty it. Refused (False) while any node is locked."""
        if self._protected > 0:
            return False
        self.allocator.free(self.all_slots())
        return self.reset()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def swa_evictable_size(self) -> int:
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def _swa_count(self, value: torch.Tensor) -> int:
        return int(self.swa.alive(value).sum()) if self.swa is not None and value.numel() else 0

    def total_size(self) -> int:
        """Tokens in the tree, counted by walking it."""
        return sum(len(n) for n in self._nodes())

    def all_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty()

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return self._aligned(i)

    # ---- match / insert ---------------------------------------------------------

    def _namespace_root(self, namespace: Any, create: bool) -> TreeNode | None:
        """Where the namespace's prefixes start: the root for None (the base model)."""
        if namespace is None:
            return self.root_node
        node = self.root_node.children.get(("namespace", namespace))
        if node is None and create:
            node = TreeNode([], self._empty(), self.root_node, 0)
            node.namespace, node.lock_ref = namespace, 1  # never evicted
            self.root_node.children[("namespace", namespace)] = node
        return node

    def drop_namespace(self, namespace: Any) -> bool:
        """Free every prefix cached under this namespace; refused (False) while one is locked."""
        top = self._namespace_root(namespace, create=False) if namespace is not None else None
        if top is None:
            return True
        nodes = list(self._subtree(top))
        if any(n.lock_ref for n in nodes):
            return False
        for n in nodes:
            self.allocator.free(n.value)
            self._evictable -= len(n)
            self._swa_evictable -= n.swa_len
            if self.events is not None:
                self.events.removed(n.hashes)
        del self.root_node.children[("namespace", namespace)]
        return True

    def _subtree(self, top: TreeNode) -> Iterator[TreeNode]:
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def match_prefix(self, key: list[int], namespace: Any = None, whole_window: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `key` in the namespace; splits a node the match ends inside.
        whole_window (sliding-window models): only a prefix whose last window still has its KV."""
        key = whole = key[: self._aligned(len(key))]
        start = self._namespace_root(namespace, create=False)
        if self.disable or not key or start is None:
            return MatchResult(self._empty(), self.root_node if start is None else start)
        now = next(self._clock)
        node, values = start, []
        node.last_access_time = now
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        indices = torch.cat(values) if values else self._empty()
        if self.swa is not None and whole_window:
            usable = swa_valid_len(self.swa.alive(indices), self.swa.window, self.page_size)
            if usable < indices.numel():  # the window before the match's end lost its KV: match less
                return self.match_prefix(whole[:usable], namespace)
        return MatchResult(indices, node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(child.key[:n], child.value[:n].clone(), parent, child.last_access_time)
        upper.lock_ref = child.lock_ref
        pages = n // self.page_size
        upper.hashes, child.hashes = child.hashes[:pages], child.hashes[pages:]
        child.key, child.value = child.key[n:], child.value[n:].clone()
        upper.swa_len = self._swa_count(upper.value)
        child.swa_len -= upper.swa_len
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def insert(self, key: list[int], value: torch.Tensor, namespace: Any = None) -> int:
        """Add the page-aligned part of `key` with its slots `value`. Returns how many
        leading tokens were already cached: their slots in `value` are duplicates the
        caller still owns and must free.

        Sliding-window models: where an unlocked node's copy lost windowed KV that the given
        copy has, the node takes the given slots and `value` gets the node's old ones in
        their place, so freeing the duplicates frees the old copy."""
        n_aligned = self._aligned(len(key))
        if self.disable or n_aligned == 0:
            return 0
        if value.numel() < n_aligned:
            raise ValueError(f"insert: {value.numel()} slots for {n_aligned} tokens")
        key, value = key[:n_aligned], value[:n_aligned]
        now = next(self._clock)
        node, present = self._namespace_root(namespace, create=True), 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            node = self._split(child, n) if n < len(child.key) else child
            if self.swa is not None and node.lock_ref == 0 and node.swa_len < n:
                self._revive(node, value[:n])
            present += n
            key, value = key[n:], value[n:]
        if key:
            leaf = TreeNode(list(key), value.clone(), node, now)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += len(leaf)
            leaf.swa_len = self._swa_count(leaf.value)
            self._swa_evictable += leaf.swa_len
            if self.events is not None:
                self._tell_stored(leaf, node, namespace)
        return present

    def _revive(self, node: TreeNode, value: torch.Tensor) -> None:
        """Swap the node's slots with `value` (same tokens) when `value` has more windowed KV."""
        alive = self._swa_count(value)
        if alive <= node.swa_len:
            return
        old = node.value
        node.value = value.clone()
        value.copy_(old)
        self._swa_evictable += alive - node.swa_len
        node.swa_len = alive

    def free_window(self, req: Any, start: int, stop: int) -> None:
        """Free the SWA pages of positions [start, stop) of the request's cached prefix, in the nodes
        only it holds (lock_ref 1): a window it left at a chunk boundary and needs no more."""
        path, node = [], req.last_node
        while node is not None and node is not self.root_node:
            path.append(node)
            node = node.parent
        pos = 0
        for n in reversed(path):
            lo, hi = max(start, pos), min(stop, pos + len(n))
            if lo < hi and n.lock_ref == 1 and n.swa_len:
                self.swa.free_swa(n.value[lo - pos:hi - pos])
                alive = self._swa_count(n.value)
                self._swa_protected -= n.swa_len - alive
                n.swa_len = alive
            pos += len(n)

    def _tell_stored(self, leaf: TreeNode, parent: TreeNode, namespace: Any) -> None:
        parent_hash = parent.hashes[-1] if parent.hashes else None  # None: the namespace's first block
        leaf.hashes = block_hashes(leaf.key, self.page_size, parent_hash, namespace)
        self.events.stored(leaf.hashes, parent_hash, leaf.key, namespace)

    # ---- locking / eviction ------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
                self._swa_evictable -= node.swa_len
                self._swa_protected += node.swa_len
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root_node:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            if node.lock_ref == 1:
                self._evictable += len(node)
                self._protected -= len(node)
                self._swa_evictable += node.swa_len
                self._swa_protected -= node.swa_len
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int, swa: bool = False) -> int:
        """Free at least num_tokens tokens from unlocked leaves, least recently used
        first (a parent left childless becomes a candidate). Returns tokens freed.
        swa: count the tokens freed in the SWA pool instead (a sliding-window model's)."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        self.allocator.free_group_begin()
        try:
            while heap and freed < num_tokens:
                _, _, node = heapq.heappop(heap)
                swa_len = node.swa_len
                full = self._delete_leaf(node)
                freed += swa_len if swa else full
                parent = node.parent
                if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        finally:
            self.allocator.free_group_end()
        return freed

    def _delete_leaf(self, node: TreeNode) -> int:
        self.allocator.free(node.value)
        if self.events is not None:
            self.events.removed(node.hashes)
        del node.parent.children[self._child_key(node.key)]
        self._evictable -= len(node)
        self._swa_evictable -= node.swa_len
        return len(node)

    # ---- request hooks -----------------------------------------------------------

    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        """Give a finished request's KV to the tree and release everything it held."""
        idx = req_pool_idx_of(req)
        n = len(token_ids)
        kv = self.req_to_token_pool.req_to_token[idx, :n].clone()
        if self.disable:
            self.allocator.free(kv)
        else:
            aligned = self._insert_req(req, token_ids, kv)
            self.allocator.free(kv[aligned:])  # the unaligned tail page
        self.req_to_token_pool.free(idx)
        self.dec_lock_ref(req.last_node)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        """After a prefill chunk: share its whole pages through the tree and move the
        request's lock to the new deepest node. The request keeps its row and its tail."""
        idx = req_pool_idx_of(req)
        n = len(token_ids)
        kv = self.req_to_token_pool.req_to_token[idx, :n].clone()
        if self.disable:
            req.prefix_indices = kv
            return
        if self.swa is not None and not self._window_shareable(req, token_ids[: self._aligned(n)], n):
            req.prefix_indices = kv  # kept its own: the tree's copy lost the window the next chunk reads
            return
        aligned = self._insert_req(req, token_ids, kv)
        # the request's own chunk: the window it goes on from is whole, the rest it may have freed
        match = self.match_prefix(token_ids[:aligned], namespace_of(req), whole_window=False)
        if match.device_indices.numel() != aligned:
            raise RuntimeError(f"re-match found {match.device_indices.numel()} of {aligned} inserted tokens")
        self.req_to_token_pool.req_to_token[idx, :aligned] = match.device_indices
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([match.device_indices, kv[aligned:]])
        req.last_node = match.last_node

    def _window_shareable(self, req: Any, key: list[int], kv_len: int) -> bool:
        """Whether the tree's copies of the request's own positions (past its locked prefix) still hold
        the windowed KV that a query at kv_len sees (another request's copy may have given it back)."""
        owned_from = self.shared_len(req)
        cached = self._peek(key, namespace_of(req))
        first = max(owned_from, kv_len - self.swa.window + 1)
        return first >= cached.numel() or bool(self.swa.alive(cached[first:]).all())

    def _peek(self, key: list[int], namespace: Any) -> torch.Tensor:
        """The slots of the longest cached prefix of `key`, changing nothing."""
        node, values = self._namespace_root(namespace, create=False), []
        while key and node is not None:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            values.append(child.value[:n])
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return torch.cat(values) if values else self._empty()

    def shared_len(self, req: Any) -> int:
        """How many leading positions of the request are the tree's (its locked path); the rest it owns."""
        n, node = 0, req.last_node
        while node is not None and node is not self.root_node:
            n += len(node)
            node = node.parent
        return n

    def _insert_req(self, req: Any, token_ids: list[int], kv: torch.Tensor) -> int:
        """Insert the aligned part and free this request's duplicates of what the tree
        already had. Returns the aligned length."""
        aligned = self._aligned(len(token_ids))
        # the tree's part of prefix_indices is its locked path; the rest is the request's own
        owned_from = self.shared_len(req)
        if owned_from > aligned:
            raise RuntimeError(f"request has {owned_from} cached tokens but only {len(token_ids)} token ids")
        present = self.insert(token_ids[:aligned], kv[:aligned], namespace_of(req))
        if present < owned_from:
            raise RuntimeError(f"locked prefix of {owned_from} tokens missing from the tree (found {present})")
        self.allocator.free(kv[owned_from:present])
        return aligned

    # ---- debugging ---------------------------------------------------------------

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            head = node.key[:8]
            more = "..." if len(node.key) > 8 else ""
            lines.append(f"{'  ' * depth}[{len(node.key)}] {head}{more} lock={node.lock_ref} t={node.last_access_time}")
            stack.extend((c, depth + 1) for c in node.children.values())
        lines.append(f"evictable={self._evictable} protected={self._protected}")
        text = "\n".join(lines)
        print(text)
        return text


def namespace_of(req: Any) -> Any:
    """The prefix namespace of a request: its LoRA adapter's name (None: the base model)."""
    return getattr(req, "lora_name", None)


def req_pool_idx_of(req: Any) -> int:
    if req.req_pool_idx is None:
        raise RuntimeError("request already released (req_pool_idx is None)")
    return int(req.req_pool_idx)
