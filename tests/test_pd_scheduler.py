"""Prefill and decode roles in one process, over real KV transfer, on the KV-reading fake model.

The fake model predicts from the KV it reads, so a decode server that got wrong or
missing KV pages produces different tokens than the colocated reference.
"""

from __future__ import annotations

import random
import time

import pytest

from fakes import FakeModelRunner, reference_generate
from tidal.config import ServerArgs
from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.messages import AbortReq, GenerateReq
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler
from servers import free_port

pytestmark = pytest.mark.timeout(120)


def make(mode: str, backend: str, port: int, page_size: int, chunk: int = 16, tokens: int = 4096) -> Scheduler:
    args = ServerArgs(model_path="fake", page_size=page_size, disaggregation_mode=mode,
                      disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=port,
                      chunked_prefill_size=chunk, disable_radix_cache=(mode == "decode"),
                      num_reserved_decode_tokens=16)
    runner = FakeModelRunner(max_total_tokens=tokens, page_size=page_size)
    if backend == "shm":
        runner.kv_pool = MHATokenToKVPool(tokens, page_size, runner.dtype, 1, 1, 1,
                                          shm_name=f"tidal-test-{port}-{mode}-{random.randrange(1 << 30)}")
    return Scheduler(args, runner, tokenizer=None)


@pytest.fixture
def pd_pair(request):
    backend, page_size = request.param
    port = free_port()
    p = make("prefill", backend, port, page_size)
    d = make("decode", backend, port, page_size)
    yield p, d, port
    d.shutdown()
    p.shutdown()


def send(p: Scheduler, d: Scheduler, port: int, rid: str, prompt: list[int], n: int, room: int, **kw) -> None:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0)
    fields = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room)
    p.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=sp, **fields, **kw))
    d.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=n, temperature=0.0),
                         **fields, **kw))


def run_pair(p: Scheduler, d: Scheduler, timeout: float = 60.0) -> tuple[dict, dict]:
    outs: tuple[dict, dict] = ({}, {})
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy = False
        for sched, out in ((p, outs[0]), (d, outs[1])):
            busy |= sched.step()
            sched.check_integrity()
            for o in sched.take_outbox():
                toks, _ = out.get(o.rid, ([], None))
                out[o.rid] = (toks + o.new_token_ids, o.finish_reason or out.get(o.rid, (None, None))[1])
        if not busy and p.is_idle() and d.is_idle():
            return outs
        if not busy:
            time.sleep(0.002)
    raise AssertionError(f"PD pair did not finish: prefill {p.role.queue_sizes()} decode {d.role.queue_sizes()}")


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


PARAMS = [("tcp", 1), ("tcp", 16), ("shm", 1), ("shm", 4),
          pytest.param(("mooncake", 16), marks=pytest.mark.skipif(not _has("mooncake.engine"),
                                                                   reason="mooncake not installed")),
          pytest.param(("nixl", 1), marks=pytest.mark.skipif(not _has("nixl"), reason="nixl not installed"))]
IDS = ["tcp-ps1", "tcp-ps16", "shm-ps1", "shm-ps4", "mooncake-ps16", "nixl-ps1"]


@pytest.mark.parametrize("pd_pair", PARAMS, indirect=True, ids=IDS)
def test_pd_outputs_equal_colocated_reference(pd_pair):
    p, d, port = pd_pair
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 70))] for _ in range(8)]
    for i, prompt in enumerate(prompts):
        send(p, d, port, f"r{i}", prompt, 12, room=rng.randrange(2**63))
    pout, dout = run_pair(p, d)
    for i, prompt in enumerate(prompts):
        toks, fin = dout[f"r{i}"]
        assert toks == reference_generate(prompt, 12), f"r{i}"
        assert fin.type == "length"
        assert pout[f"r{i}"][0] == reference_generate(prompt, 1)
    assert p.mem.tree_cache.total_size() > 0  # prefill keeps prefixes in its radix cache
    stats = d.role.transfer.stats()
    assert stats["succeeded"] >= len(prompts)


@pytest.mark.parametrize("pd_pair", [("tcp", 1)], indirect=True)
def test_prefill_rejects_requests_without_bootstrap(pd_pair):
    p, d, port = pd_pair
    p.handle(GenerateReq(rid="x", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4)))
    (out,) = p.take_outbox()
    assert out.finish_reason.type == "abort" and out.finish_reason.status_code == 400


@pytest.mark.parametrize("pd_pair", [("tcp", 1)], indirect=True)
def test_decode_prefills_locally_without_bootstrap(pd_pair):
    p, d, port = pd_pair
    d.handle(GenerateReq(rid="local", input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=6, temperature=0)))
    _, dout = run_pair(p, d)
    assert dout["local"][0] == reference_generate([5, 6, 7], 6)


@pytest.mark.parametrize("pd_pair", [("tcp", 1)], indirect=True)
def test_abort_on_decode_frees_both_sides(pd_pair):
    p, d, port = pd_pair
    send(p, d, port, "a", list(range(1, 40)), 50, room=123)
    send(p, d, port, "b", list(range(2, 30)), 5, room=456)
    for _ in range(3):
        p.step()
        d.step()
    d.handle(AbortReq(rid="a"))
    pout, dout = run_pair(p, d)
    assert dout["a"][1].type == "abort"
    # the prefill hears of it from decode, also when decode aborts before its room has paired (not at its
    # bootstrap timeout, 30 s)
    assert "aborted by decode" in pout["a"][1].message
    assert dout["b"][0] == reference_generate(list(range(2, 30)), 5)
    assert p.is_idle() and d.is_idle()


@pytest.mark.parametrize("pd_pair", [("tcp", 1)], indirect=True)
def test_decode_without_prefill_partner_times_out_cleanly(pd_pair, monkeypatch):
    p, d, port = pd_pair
    monkeypatch.setenv("TIDAL_DISAGG_BOOTSTRAP_TIMEOUT", "1")
    dead_port = free_port()
    d2 = make("decode", "tcp", port, 1)
    try:
        d2.handle(GenerateReq(rid="lonely", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3),
                              bootstrap_host="127.0.0.1", bootstrap_port=dead_port, bootstrap_room=7))
        deadline = time.time() + 30
        outs = []
        while time.time() < deadline and not outs:
            d2.step()
            outs = d2.take_outbox()
            time.sleep(0.01)
        assert outs and outs[0].finish_reason.type == "abort"
        assert outs[0].finish_reason.message
        d2.check_integrity()
    finally:
        d2.shutdown()


def test_a_request_a_full_decode_pool_never_takes_fails_with_503_at_the_deadline_on_both_sides(monkeypatch):
    """Decode OOM: the prealloc queue never finds room for the prompt. Both sides end the request by the
    bootstrap deadline (the decode one with a 503: a full server, which the router retries elsewhere and
    never counts against the worker's circuit breaker), free everything, and the next request is served."""
    monkeypatch.setenv("TIDAL_DISAGG_BOOTSTRAP_TIMEOUT", "1")
    port = free_port()
    p = make("prefill", "tcp", port, 1)
    d = make("decode", "tcp", port, 1)
    preallocate = d.role._preallocate
    d.role._preallocate = lambda req: False  # the pool stays full (a prompt larger than the pool is a 400 at once)
    try:
        send(p, d, port, "stuck", list(range(1, 41)), 4, room=11)
        started = time.time()
        pout, dout = run_pair(p, d, timeout=20)
        assert time.time() - started < 5
        fin = dout["stuck"][1]
        assert fin.type == "abort" and fin.status_code == 503 and "no KV room" in fin.message, fin
        assert pout["stuck"][1].type == "abort"
        d.role._preallocate = preallocate
        send(p, d, port, "small", [3, 4, 5], 4, room=12)
        _, dout = run_pair(p, d)
        assert dout["small"][0] == reference_generate([3, 4, 5], 4)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_loop_waiting_on_a_hand_off_polls_briefly_not_the_idle_wait():
    """Hand-off progress happens on the transfer thread and does not wake the scheduler's poller:
    while a request waits on it, an iteration that ran nothing must look again within
    WAITING_POLL_MS, not sleep IDLE_POLL_MS (which cost every PD request ~200 ms of TTFT)."""
    from tidal.scheduler.process import IDLE_POLL_MS, WAITING_POLL_MS, idle_poll_ms

    port = free_port()
    p, d = make("prefill", "tcp", port, 1), make("decode", "tcp", port, 1)
    try:
        assert idle_poll_ms(p.is_idle()) == idle_poll_ms(d.is_idle()) == IDLE_POLL_MS
        send(p, d, port, "r0", list(range(5, 25)), 4, room=7)
        p.step()
        d.step()
        assert not p.is_idle() and not d.is_idle()
        assert idle_poll_ms(p.is_idle()) == idle_poll_ms(d.is_idle()) == WAITING_POLL_MS < IDLE_POLL_MS
        run_pair(p, d)
        assert idle_poll_ms(p.is_idle()) == idle_poll_ms(d.is_idle()) == IDLE_POLL_MS
    finally:
        d.shutdown()
        p.shutdown()
