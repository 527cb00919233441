"""Multi-LoRA parts without a server: the radix cache's per-adapter namespaces, the
--max-loras-per-batch admission filter, LoRALinear over the quantized base layers, and the flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from tidal.config import ServerArgs, add_server_args, server_args_from_namespace
from tidal.kvcache import PagedTokenAllocator, RadixCache, ReqToTokenPool, check_integrity


@dataclass
class NsReq:
    """What the cache hooks read from a request, with the adapter it runs with."""

    req_pool_idx: Optional[int]
    lora_name: Optional[str]
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def _run_request(cache: RadixCache, pool: ReqToTokenPool, tokens: list[int], lora: Optional[str]) -> int:
    """Match, lock, compute the rest, finish; returns how many tokens came from the cache."""
    m = cache.match_prefix(tokens[:-1], lora)
    req = NsReq(pool.alloc(), lora, m.device_indices, m.last_node)
    cache.inc_lock_ref(m.last_node)
    n = m.device_indices.numel()
    row = pool.req_to_token[req.req_pool_idx]
    row[:n] = m.device_indices
    row[n:len(tokens)] = cache.allocator.alloc(len(tokens) - n)
    cache.cache_finished_req(req, tokens)
    return n


@pytest.mark.parametrize("ps", [1, 4])
def test_radix_prefixes_never_cross_adapters(ps):
    pool, alloc = ReqToTokenPool(8, 128), PagedTokenAllocator(64 * ps, ps, debug=True)
    cache = RadixCache(pool, alloc, ps)
    prompt = list(range(1, 4 * ps + 2))
    assert _run_request(cache, pool, prompt, "x") == 0
    assert _run_request(cache, pool, prompt, "y") == 0  # x's KV is not y's
    assert _run_request(cache, pool, prompt, None) == 0  # nor the base model's
    for lora in ("x", "y", None):
        assert _run_request(cache, pool, prompt, lora) == 4 * ps  # each reuses its own
    check_integrity(pool, alloc, cache, [])
    held = cache.total_size()
    per_adapter = len(prompt) // ps * ps
    assert held == 3 * per_adapter
    assert cache.drop_namespace("x") and cache.total_size() == held - per_adapter
    assert _run_request(cache, pool, prompt, "x") == 0  # dropped: a reloaded adapter starts afresh
    cache.evict(10**6)
    check_integrity(pool, alloc, cache, [])
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size  # namespace heads hold nothing


def test_locked_namespace_is_not_dropped():
    pool, alloc = ReqToTokenPool(8, 64), PagedTokenAllocator(64, 1, debug=True)
    cache = RadixCache(pool, alloc, 1)
    _run_request(cache, pool, [5, 6, 7, 8], "x")
    m = cache.match_prefix([5, 6, 7], "x")
    cache.inc_lock_ref(m.last_node)
    assert not cache.drop_namespace("x")
    cache.dec_lock_ref(m.last_node)
    assert cache.drop_namespace("x")
    check_integrity(pool, alloc, cache, [])


# ---------------------------------------------------------------- admission


def _lora_scheduling(max_per_batch: int):
    from tidal.scheduler.lora import LoRAScheduling

    sched = SimpleNamespace(runner=SimpleNamespace(lora=object()),
                            args=SimpleNamespace(max_loras_per_batch=max_per_batch))
    return LoRAScheduling(sched)


def test_admission_keeps_distinct_adapters_within_the_limit():
    lora = _lora_scheduling(2)

    def reqs(*names):
        return [SimpleNamespace(lora_name=n) for n in names]

    running = reqs("a", None)
    waiting = reqs("b", "c", None, "a", "b", "d")
    picked = lora.admissible(waiting, running)
    assert [r.lora_name for r in picked] == ["b", None, "a", "b"]  # c and d would be a third adapter
    assert lora.fits(reqs("a")[0], running) and not lora.fits(reqs("c")[0], reqs("a", "b"))


# ---------------------------------------------------------------- quantized base layers


def _delta_reference(x, a, b):
    return (x.double() @ a.double().t()) @ b.double().t()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_lora_linear_adds_only_its_rows_delta_over_quantized_bases(kind):
    from tidal.model.lora import LoRAAdapter, LoRALinear, LoRAPass, column_masks, stack_adapters
    from tidal.model.quant import Int4Linear, Int4Weight, Int8Linear, int4_kernel_available

    if not int4_kernel_available():
        pytest.skip("this torch has no int4/int8 CPU kernels")
    g = torch.Generator().manual_seed(0)
    out_f, in_f, r = 64, 96, 4
    if kind == "int8":
        base = Int8Linear(torch.randn(out_f, in_f, generator=g), None, max_quant_tokens=8, keep_dense=False)
    else:
        w = Int4Weight(torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g),
                       torch.rand(out_f, in_f // 32, generator=g) * 0.1, torch.zeros(out_f, in_f // 32))
        base = Int4Linear(w, None, None, max_quant_tokens=0)
    key = (0, "self_attn.o_proj")
    ab = {name: (torch.randn(r, in_f, generator=g), torch.randn(out_f, r, generator=g) * 0.1) for name in "pq"}
    adapters = [LoRAAdapter(n, "/none", r, ("o_proj",), {key: ab[n]}, {"self_attn.o_proj": r}) for n in "pq"]
    rows = {"p": [1, 3], "q": [2]}
    lora = LoRAPass(stack_adapters(adapters), column_masks(adapters, [torch.tensor(rows[n]) for n in "pq"], 5,
                                                             torch.float32, torch.device("cpu")))
    layer = LoRALinear(base, 0, "self_attn.o_proj", SimpleNamespace(current=lambda: lora))
    x = torch.randn(5, in_f, generator=g)
    with torch.inference_mode():
        got, plain = layer(x), base(x)
    expect = plain.double().clone()
    for n in "pq":
        expect[rows[n]] += _delta_reference(x[rows[n]], *ab[n])
    assert torch.allclose(got.double(), expect, atol=1e-4)
    assert torch.equal(got[[0, 4]], plain[[0, 4]])  # rows without an adapter: exactly the base output


# ---------------------------------------------------------------- flags


def _parse(*argv: str) -> ServerArgs:
    p = argparse.ArgumentParser()
    add_server_args(p)
    return server_args_from_namespace(p.parse_args(["--model-path", "/m.gguf", *argv]))


def test_lora_flags():
    args = _parse("--lora-paths", "a=/x/a", "/y/b", "--max-loras-per-batch", "3")
    assert args.enable_lora and args.lora_adapters == {"a": "/x/a", "/y/b": "/y/b"}
    assert args.max_loras_per_batch == 3 and args.max_lora_rank is None
    assert _parse().enable_lora is False and _parse().max_loras_per_batch == 8
    assert _parse("--enable-lora", "--lora-target-modules", "q_proj", "all").lora_target_modules == ("q_proj", "all")
    with pytest.raises(ValueError, match="twice"):
        _parse("--lora-paths", "a=/x", "a=/y")
    with pytest.raises(ValueError, match="--tp > 1"):
        _parse("--enable-lora", "--tp", "2")
    with pytest.raises(ValueError, match="--enable-torch-compile"):
        _parse("--enable-lora", "--enable-torch-compile")
    with pytest.raises(ValueError, match="--max-loras-per-batch"):
        _parse("--enable-lora", "--max-loras-per-batch", "0")


# ---------------------------------------------------------------- the scheduler with a fake runner


class AdapterTable:
    """The runner's LoRA manager as the scheduler sees it: names in, names out (no weights)."""

    def __init__(self, names):
        self.adapters = {n: n for n in names}

    def paths(self):
        return dict(self.adapters)

    def unload(self, name):
        del self.adapters[name]


def _lora_sched(max_per_batch: int):
    from fakes import FakeModelRunner

    from tidal.scheduler.scheduler import Scheduler

    class Runner(FakeModelRunner):
        def __init__(self):
            super().__init__()
            self.lora = AdapterTable(["a", "b", "c"])
            self.batches: list = []

        def forward(self, fb, logit_rows):
            self.batches.append(fb.lora_names)
            return super().forward(fb, logit_rows)

    args = ServerArgs(model_path="fake", max_loras_per_batch=max_per_batch, disable_overlap_schedule=True)
    return Scheduler(args, Runner(), tokenizer=None)


def test_scheduler_batches_at_most_max_loras_per_batch_adapters():
    from fakes import reference_generate
    from test_scheduler import run_to_end, submit

    sched = _lora_sched(2)
    names = ["a", "b", "c", None, "a", "c", "b", None]
    for i, name in enumerate(names):
        submit(sched, f"r{i}", [i + 1, 7, 9, 11], 6, lora_name=name)
    out = run_to_end(sched)
    for i in range(len(names)):
        assert out[f"r{i}"][0] == reference_generate([i + 1, 7, 9, 11], 6)
    distinct = [len({n for n in batch if n is not None}) for batch in sched.runner.batches if batch]
    assert max(distinct) == 2  # adapters share batches, never more than the limit


def test_scheduler_refuses_unknown_adapters_and_unloading_one_in_use():
    from test_scheduler import run_to_end, submit

    from tidal.messages import UnloadLoRAReq

    sched = _lora_sched(8)
    submit(sched, "bad", [1, 2, 3], 4, lora_name="zzz")
    bad = sched.take_outbox()[0]
    assert bad.finish_reason.status_code == 400 and "zzz" in bad.finish_reason.message
    submit(sched, "r", [1, 2, 3], 40, lora_name="a")
    sched.step()
    sched.handle(UnloadLoRAReq(call_id=1, lora_name="a"))
    busy = sched.take_replies()[0]
    assert busy.status_code == 400 and "in use" in busy.message
    run_to_end(sched)
    sched.handle(UnloadLoRAReq(call_id=2, lora_name="a"))
    done = sched.take_replies()[0]
    assert done.success and "a" not in done.adapters


def test_adapter_paths_are_hidden_like_model_paths():
    from tidal.config import hide_model_paths

    info = {"lora_paths": ["a=/secret/a", "/secret/b"], "scheduler_info": {"lora_adapters": {"a": "/secret/a"}}}
    assert "/secret" not in str(hide_model_paths(info, "m"))
