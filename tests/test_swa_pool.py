"""The sliding-window KV pool (tidal/kvcache/swa.py): windowed layers in buffers of their own whose
pages are freed once out of every window, with the radix cache, chunked prefill and both attention
backends giving transformers' greedy tokens, and the pools' integrity checked after every step."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import one_thread  # noqa: F401  (autouse fixture)
from test_sliding_window import FAMILIES, TINY, _seqs
from tiny_models import tiny_hf

from tidal.kvcache import RadixCache, ReqToTokenPool, check_integrity
from tidal.kvcache.swa import SWAPagedAllocator, check_swa, swa_valid_len

MAX_NEW = 12


def _allocator(full: int = 64, swa: int = 16, page_size: int = 4, window: int = 6) -> SWAPagedAllocator:
    return SWAPagedAllocator(full, swa, page_size, window, torch.zeros(full // page_size + 1, dtype=torch.int64),
                             debug=True)


def test_pages_are_taken_and_freed_in_step():
    a = _allocator()
    slots = a.alloc_extend([0], [10], [-1])  # 3 full pages, 3 SWA pages
    assert a.available_size() == 64 - 12 and a.swa_available_size() == 16 - 12
    assert bool(a.alive(slots).all())
    swa = a.swa_slots(slots)
    assert torch.equal(swa % 4, slots % 4) and bool((swa >= 4).all())  # same offsets, never the dummy page
    more = a.alloc_extend([10], [12], [int(slots[-1])])  # continues in the partial page: no new page
    assert torch.equal(more, slots[-1:] + torch.tensor([1, 2])) and a.swa_available_size() == 4
    a.free_swa(slots[:4])  # the first page leaves the window: its SWA page only
    assert a.swa_available_size() == 8 and a.available_size() == 52
    assert a.alive(slots).tolist() == [False] * 4 + [True] * 6
    assert torch.equal(a.swa_slots(slots[:4]), slots[:4] % 4)  # dead -> the dummy page
    a.free_swa(slots[:4])  # freeing again is a no-op, not a double free
    a.free(torch.cat([slots, more]))
    assert a.available_size() == 64 and a.swa_available_size() == 16 and not bool(a.page_map.any())


def test_a_full_swa_pool_refuses_all_or_nothing():
    a = _allocator(full=64, swa=8)
    assert a.alloc_extend([0], [12], [-1]) is None  # 3 pages, only 2 SWA pages
    assert a.available_size() == 64 and a.swa_available_size() == 8 and not bool(a.page_map.any())


def test_integrity_names_leaks_and_stale_maps():
    a = _allocator()
    pool = ReqToTokenPool(2, 64)
    cache = RadixCache(pool, a, 4)
    slots = a.alloc(8)
    assert check_swa(a, cache) == []
    a.swa._free_pages = a.swa._free_pages[1:]  # an SWA page lost
    assert any("leaked" in e for e in check_swa(a, cache))
    a.swa.clear()
    a.page_map[int(a.full.free_pages()[0])] = 1
    assert any("free full pages still map" in e for e in check_swa(a, cache))
    del slots


@pytest.mark.parametrize("alive,window,page,want", [
    ([1] * 12, 4, 1, 12),
    ([0] * 6 + [1] * 6, 4, 1, 12),  # the last 4 alive: the whole match
    ([0] * 6 + [1] * 6, 8, 1, 0),  # a window of 8 reaches a dead position, and so does every shorter end
    ([0] * 3 + [1] * 4 + [0] * 3 + [1] * 2, 4, 1, 7),  # ends at 7 (positions 3-6 alive)
    ([0] * 4 + [1] * 4 + [0] * 4, 4, 4, 8),
    ([0] * 4 + [1] * 7 + [0], 4, 4, 8),  # 11 would do, but matches end on pages
])
def test_valid_match_length(alive, window, page, want):
    assert swa_valid_len(torch.tensor(alive, dtype=torch.bool), window, page) == want


def test_the_tree_matches_only_prefixes_with_a_whole_window():
    a = _allocator(full=64, swa=64, page_size=1, window=4)
    pool = ReqToTokenPool(2, 64)
    cache = RadixCache(pool, a, 1)
    key = list(range(20))
    slots = a.alloc(20)
    a.free_swa(slots[:10])  # a request gave back positions 0-9 as it went
    cache.insert(key, slots)
    assert cache.swa_evictable_size() == 10 and cache.evictable_size() == 20
    assert cache.match_prefix(key).device_indices.numel() == 20
    assert cache.match_prefix(key[:12]).device_indices.numel() == 0  # a query at 12 sees 9-11: 9 is gone
    assert cache.match_prefix(key[:12], whole_window=False).device_indices.numel() == 12
    assert check_swa(a, cache) == []
    check_integrity(pool, a, cache, [])
    assert cache.evict(1, swa=True) == 8  # the LRU leaf (positions 12-19), counted in SWA tokens
    assert cache.evict(1, swa=True) == 2 and cache.swa_evictable_size() == 0
    assert a.swa_available_size() == 64 and cache.total_size() == 0


def _serve(path: str, prompts: list[list[int]], backend: str, ratio: float, page_size: int, chunk: int,
           rounds: list[list[int]], compiled: bool = False):
    """Runs each round's prompts through one scheduler; (tokens per round, peak SWA and full tokens used).
    ratio 1: one pool (the reference)."""
    from tidal.config import ServerArgs
    from tidal.messages import GenerateReq
    from tidal.model.runner import ModelRunner
    from tidal.sampling_params import SamplingParams
    from tidal.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=path, dtype="float32", device="cpu", page_size=page_size, chunked_prefill_size=chunk,
                      max_total_tokens=512, torch_threads=1, attention_backend=backend, swa_full_tokens_ratio=ratio,
                      enable_torch_compile=compiled, torch_compile_max_bs=4)
    runner = ModelRunner(args)
    if backend == "flex":
        runner.attn_backend.use_eager()
    sched = Scheduler(args, runner, tokenizer=None)
    mem = sched.mem
    assert (mem.swa is not None) == bool(runner.kv_pool.swa_layers) == (ratio < 1)
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs, peak = [], [0, 0]
    for n, idx in enumerate(rounds):
        for i in idx:
            sched.handle(GenerateReq(rid=f"r{n}-{i}", input_ids=prompts[i], sampling=sp))
        out: dict[int, list[int]] = {}
        for _ in range(400):
            did = sched.step()
            sched.check_integrity()
            if mem.swa is not None:
                peak[0] = max(peak[0], mem.swa.swa.size - mem.swa.swa_available_size())
                peak[1] = max(peak[1], mem.swa.size - mem.swa.available_size())
            for o in sched.take_outbox():
                out.setdefault(int(o.rid.split("-")[1]), []).extend(o.new_token_ids)
            if not did and sched.is_idle():
                break
        outs.append([out[i] for i in idx])
    return outs, peak, sched, runner


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed(request, tmp_path_factory):
    cls, kw, _ = FAMILIES[request.param]
    hf = tiny_hf(cls, **{**TINY, **kw})
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    prompts = _seqs(4, [40, 9, 26, 33])
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=None)
            want.append(out[0, len(p):].tolist())
    return str(path), prompts, want


@pytest.mark.parametrize("backend", ["torch", "flex"])
@pytest.mark.parametrize("page_size,chunk", [(1, 16), (4, 12)])
def test_a_small_swa_pool_serves_transformers_tokens(windowed, backend, page_size, chunk):
    """An SWA pool far smaller than the requests' KV (freed as they go), radix cache on, chunked prefill
    across the window: transformers' greedy tokens, again from cached prefixes, both pools whole."""
    path, prompts, want = windowed
    outs, (swa_peak, full_peak), sched, runner = _serve(path, prompts, backend, 0.08, page_size, chunk,
                                                        [[0, 1, 2, 3], [0, 2]])
    assert outs == [want, [want[0], want[2]]]
    swa_size = runner.swa_size
    assert swa_size < sum(len(p) + MAX_NEW for p in prompts)  # could not hold what the requests computed
    assert swa_peak <= swa_size < full_peak


def test_the_compiled_decode_step_over_the_swa_pool(windowed):
    """The compiled decode step (the default on CPUs) reads and writes the windowed buffers through the
    translated slots: the eager step's tokens."""
    path, prompts, want = windowed
    if "gemma3" not in path:
        pytest.skip("one family is enough for the compiled step (compile time)")
    outs, _, _, runner = _serve(path, prompts, "torch", 0.1, 4, 12, [[0, 1, 2, 3]], compiled=True)
    assert runner.compiled is not None  # it compiled and did not fall back
    assert outs == [want]


@pytest.mark.parametrize("page_size,chunk", [(1, 16), (4, 12)])
def test_a_prompt_sent_again_hits_its_cached_end(windowed, page_size, chunk):
    """A finished request leaves the window at its prompt's end in the tree (the last chunk's), so the same
    prompt again (or a next chat turn) is served from the cache up to there."""
    path, prompts, want = windowed
    outs, _, sched, _ = _serve(path, prompts, "torch", 0.5, page_size, chunk, [[0], [0]])
    assert outs == [[want[0]], [want[0]]]
    window = 6
    assert sched.stats.total_cached_tokens >= len(prompts[0]) - 1 - window - page_size


def test_pool_bytes_follow_the_ratio(windowed):
    from tidal.config import ServerArgs
    from tidal.model.runner import ModelRunner

    path = windowed[0]
    sizes = {}
    for ratio in (1.0, 0.25):
        args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=4096, torch_threads=1,
                          swa_full_tokens_ratio=ratio, enable_torch_compile=False, chunked_prefill_size=64)
        runner = ModelRunner(args)
        sizes[ratio] = (runner.kv_pool.nbytes(), len(runner.kv_pool.swa_layers), runner.swa_size)
    one_pool, windowed_layers = sizes[1.0][0], sizes[0.25][1]
    assert sizes[1.0][1] == 0 and sizes[0.25][2] == 1024
    layers = runner.model_config.num_layers
    want = one_pool * (layers - windowed_layers + 0.25 * windowed_layers) / layers
    assert abs(sizes[0.25][0] - want) / want < 0.01  # the dummy pages aside


def test_flags_that_need_one_pool_are_clear_errors():
    from tidal.config import ServerArgs

    with pytest.raises(ValueError, match="does not transfer KV yet"):
        ServerArgs(model_path="m", disaggregation_mode="prefill", swa_full_tokens_ratio=0.5).validate()
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        ServerArgs(model_path="m", swa_full_tokens_ratio=0.0).validate()
    ServerArgs(model_path="m", disaggregation_mode="prefill").validate()  # default: one pool there


@pytest.mark.parametrize("ratio", [0.1, 0.25])  # 0.1: evicted by SWA pressure
@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefixes_in_waves_equal_one_pool(windowed, page_size, ratio):
    """Requests on three shared prefixes in waves (matches trimmed to whole windows, chunk windows given
    back, copies revived, SWA eviction under a small pool): the one pool's greedy tokens, pools whole."""
    import random

    path = windowed[0]
    rng = random.Random(page_size)
    heads = [[rng.randrange(1, 128) for _ in range(n)] for n in (22, 27, 30)]
    prompts = [heads[i % 3] + [rng.randrange(1, 128) for _ in range(rng.randrange(3, 20))] for i in range(12)]
    waves = [[0, 1, 2, 3], [4, 5, 6, 7, 0], [8, 9, 10, 11, 4]]
    one, _, _, _ = _serve(path, prompts, "torch", 1.0, page_size, 12, waves)
    outs, (swa_peak, _), sched, runner = _serve(path, prompts, "torch", ratio, page_size, 12, waves)
    assert outs == one
    assert swa_peak <= runner.swa_size
    assert sched.stats.total_cached_tokens > 0 or ratio < 0.25

