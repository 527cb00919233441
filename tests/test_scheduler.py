"""Scheduler tests on a fake model runner: batching, caching, chunking, retraction, aborts."""

from __future__ import annotations

import random

import pytest

from fakes import FakeModelRunner, reference_generate
from tidal.config import ServerArgs
from tidal.messages import AbortReq, FlushCacheReq, GenerateReq, StatsReq
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler


def make_sched(max_total_tokens=4096, page_size=1, **kw) -> Scheduler:
    args = ServerArgs(model_path="fake", page_size=page_size, **kw)
    runner = FakeModelRunner(max_total_tokens=max_total_tokens, page_size=page_size)
    return Scheduler(args, runner, tokenizer=None)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def submit(sched: Scheduler, rid: str, prompt: list[int], n: int, **kw) -> None:
    sched.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=greedy(n), **kw))


def run_to_end(sched: Scheduler, max_steps: int = 20000) -> dict:
    """Step until idle; check pool integrity after every step. Returns rid -> (tokens, finish)."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, object] = {}
    for _ in range(max_steps):
        did = sched.step()
        sched.check_integrity()
        for out in sched.take_outbox():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.rid] = out
        if not did and sched.is_idle():
            break
    else:
        raise AssertionError("scheduler did not finish")
    for r in sched.running:
        r.check_invariants()
    return {rid: (tokens.get(rid, []), finish.get(rid)) for rid in set(tokens) | set(finish)}


def prompts(n: int, lo: int = 5, hi: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("chunk", [-1, 16])
def test_outputs_match_reference(page_size, chunk):
    sched = make_sched(page_size=page_size, chunked_prefill_size=chunk if chunk < 0 else max(chunk, page_size))
    ps = prompts(12)
    for i, p in enumerate(ps):
        submit(sched, f"r{i}", p, 20)
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        toks, fin = res[f"r{i}"]
        assert toks == reference_generate(p, 20), f"r{i}"
        assert fin.finish_reason.type == "length"
        assert fin.prompt_tokens == len(p) and fin.completion_tokens == 20


def test_requests_are_batched_in_decode():
    sched = make_sched()
    for i, p in enumerate(prompts(8)):
        submit(sched, f"r{i}", p, 10)
    run_to_end(sched)
    decode_sizes = [bs for mode, bs in sched.runner.forward_calls if mode == "decode"]
    assert max(decode_sizes) == 8
    assert sched.stats.max_decode_batch_size == 8


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_cache_hit_and_correct(page_size):
    sched = make_sched(page_size=page_size)
    shared = list(range(1, 70))
    submit(sched, "a", shared + [5, 6, 7], 8)
    run_to_end(sched)
    submit(sched, "b", shared + [9, 9], 8)
    res = run_to_end(sched)
    toks, fin = res["b"]
    assert toks == reference_generate(shared + [9, 9], 8)
    expected_cached = len(shared) // page_size * page_size
    assert fin.cached_tokens == expected_cached > 0
    assert sched.stats.cache_hit_rate() > 0


def test_disable_radix_cache_has_no_hits():
    sched = make_sched(disable_radix_cache=True)
    shared = list(range(1, 50))
    submit(sched, "a", shared + [1], 4)
    run_to_end(sched)
    submit(sched, "b", shared + [2], 4)
    res = run_to_end(sched)
    assert res["b"][1].cached_tokens == 0
    assert res["b"][0] == reference_generate(shared + [2], 4)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_chunks_long_prompt(page_size):
    sched = make_sched(page_size=page_size, chunked_prefill_size=8)
    p = list(range(1, 60))
    submit(sched, "long", p, 5)
    submit(sched, "short", [3, 4, 5], 5)
    res = run_to_end(sched)
    assert res["long"][0] == reference_generate(p, 5)
    assert res["short"][0] == reference_generate([3, 4, 5], 5)
    extends = [bs for mode, bs in sched.runner.forward_calls if mode == "extend"]
    assert len(extends) >= 59 // 8


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_memory_pressure_keeps_outputs_exact(page_size):
    sched = make_sched(max_total_tokens=320, page_size=page_size, chunked_prefill_size=64)
    ps = prompts(10, lo=10, hi=20, seed=3)
    for i, p in enumerate(ps):
        submit(sched, f"r{i}", p, 40)
    res = run_to_end(sched)
    assert sched.stats.num_retracted > 0
    for i, p in enumerate(ps):
        assert res[f"r{i}"][0] == reference_generate(p, 40), f"r{i}"


def test_max_running_requests_is_respected():
    sched = make_sched(max_running_requests=3)
    for i, p in enumerate(prompts(9)):
        submit(sched, f"r{i}", p, 6)
    res = run_to_end(sched)
    assert len(res) == 9
    assert max(bs for _, bs in sched.runner.forward_calls) <= 3


def test_max_prefill_tokens_splits_prefill_batches():
    sched = make_sched(max_prefill_tokens=40, chunked_prefill_size=-1)
    for i in range(4):
        submit(sched, f"r{i}", [100 * i + 1 + j for j in range(30)], 2)
    run_to_end(sched)
    extends = [bs for mode, bs in sched.runner.forward_calls if mode == "extend"]
    assert max(extends) <= 2 and len(extends) >= 2


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random"])
def test_every_policy_serves_correctly(policy):
    sched = make_sched(schedule_policy=policy)
    ps = prompts(10, seed=7)
    for i, p in enumerate(ps):
        submit(sched, f"r{i}", p, 5)
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        assert res[f"r{i}"][0] == reference_generate(p, 5)


def test_abort_waiting_and_running():
    sched = make_sched(max_running_requests=1)
    submit(sched, "run", [1, 2, 3], 50)
    submit(sched, "wait", [4, 5, 6], 50)
    for _ in range(3):
        sched.step()
    sched.handle(AbortReq(rid="wait"))
    sched.handle(AbortReq(rid="run"))
    res = run_to_end(sched)
    assert res["wait"][1].finish_reason.type == "abort"
    assert res["run"][1].finish_reason.type == "abort"
    assert len(res["run"][0]) < 50
    assert sched.is_idle()


def test_abort_all_and_chunked_abort():
    sched = make_sched(chunked_prefill_size=4)
    submit(sched, "a", list(range(1, 40)), 10)
    submit(sched, "b", [1, 2], 10)
    sched.step()  # first chunk of "a"
    sched.handle(AbortReq(abort_all=True))
    res = run_to_end(sched)
    assert {res[r][1].finish_reason.type for r in ("a", "b")} == {"abort"}


def test_bad_requests_are_rejected_not_crashing():
    sched = make_sched()
    sched.handle(GenerateReq(rid="empty", input_ids=[], sampling=greedy(3)))
    sched.handle(GenerateReq(rid="oov", input_ids=[1, 99999], sampling=greedy(3)))
    sched.handle(GenerateReq(rid="long", input_ids=[1] * 5000, sampling=greedy(3)))
    sched.handle(GenerateReq(rid="topp", input_ids=[1], sampling=SamplingParams(top_p=2.0)))
    submit(sched, "ok", [1, 2], 3)
    res = run_to_end(sched)
    for rid in ("empty", "oov", "long", "topp"):
        fr = res[rid][1].finish_reason
        assert fr.type == "abort" and fr.status_code == 400 and fr.message
    assert res["ok"][0] == reference_generate([1, 2], 3)


def test_stop_token_ids_and_streaming_increments():
    sched = make_sched()
    p = [7, 8, 9]
    ref = reference_generate(p, 10)
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[ref[3]])
    sched.handle(GenerateReq(rid="s", input_ids=p, sampling=sp, stream=True))
    chunks = []
    for _ in range(100):
        did = sched.step()
        chunks += sched.take_outbox()
        if not did and sched.is_idle():
            break
    assert [c.new_token_ids for c in chunks][:4] == [[t] for t in ref[:4]]
    assert chunks[-1].finish_reason.type == "stop" and chunks[-1].finish_reason.matched == ref[3]


@pytest.mark.parametrize("stream_interval", [1, 4])
def test_the_first_token_goes_out_at_once_streamed_or_not(stream_interval):
    """The API process times a request's TTFT (its metrics, meta_info.first_token_latency) by the first
    output that reaches it: a non-streamed request's, or a stream's under a longer --stream-interval, must
    not wait for the end or the interval."""
    sched = make_sched(stream_interval=stream_interval)
    submit(sched, "whole", [7, 8, 9], 6)
    submit(sched, "streamed", [4, 5, 6], 6, stream=True)
    outputs: list = []
    for _ in range(100):
        did = sched.step()
        outputs += sched.take_outbox()
        if not did and sched.is_idle():
            break
    for rid in ("whole", "streamed"):
        mine = [o for o in outputs if o.rid == rid]
        assert len(mine[0].new_token_ids) == 1 and mine[0].finish_reason is None
        assert sum(len(o.new_token_ids) for o in mine) == 6 and mine[-1].finish_reason is not None
    whole = [o for o in outputs if o.rid == "whole"]
    assert len(whole) == 2  # the first token, then the rest with the finish


def test_flush_cache_and_stats():
    sched = make_sched()
    submit(sched, "a", list(range(1, 30)), 3)
    run_to_end(sched)
    assert sched.mem.tree_cache.total_size() > 0
    sched.handle(StatsReq(call_id=1))
    sched.handle(FlushCacheReq(call_id=2))
    stats, flushed = sched.take_replies()
    assert stats.num_running_reqs == 0 and stats.total_prompt_tokens == 29
    assert flushed.success
    assert sched.mem.tree_cache.total_size() == 0
    sched.check_integrity()


def test_random_workload_integrity():
    rng = random.Random(11)
    sched = make_sched(max_total_tokens=600, page_size=4, chunked_prefill_size=32, schedule_policy="lpm")
    base = [rng.randrange(1, 500) for _ in range(40)]
    expected = {}
    for i in range(40):
        p = base[: rng.randint(0, 40)] + [rng.randrange(1, 500) for _ in range(rng.randint(1, 30))]
        n = rng.randint(1, 30)
        submit(sched, f"r{i}", p, n)
        expected[f"r{i}"] = reference_generate(p, n)
        if rng.random() < 0.5:
            sched.step()
            sched.check_integrity()
        if rng.random() < 0.1:
            sched.handle(AbortReq(rid=f"r{rng.randrange(i + 1)}"))
    res = run_to_end(sched)
    for rid, ref in expected.items():
        toks, fin = res[rid]
        if fin.finish_reason.type != "abort":
            assert toks == ref, rid


def test_stats_count_the_prompt_tokens_still_to_prefill():
    sched = make_sched(chunked_prefill_size=8)
    submit(sched, "long", list(range(1, 60)), 2)
    submit(sched, "short", [3, 4, 5], 2)
    assert sched.make_stats(0).queued_prefill_tokens == 59 + 3
    sched.step()  # the first 8-token chunk of "long"
    assert sched.make_stats(0).queued_prefill_tokens == 59 + 3 - 8
    run_to_end(sched)
    assert sched.make_stats(0).queued_prefill_tokens == 0
