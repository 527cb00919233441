"""`--enable-torch-compile`: the decode step compiled by inductor gives the eager step's logits.

The model runs float32 here (the exact path), so compiled and eager may differ only by the
order of float32 sums inside fused kernels. Compiling costs a minute or so on a small CPU:
one module-scoped runner serves every in-process test.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import one_thread  # noqa: F401  (autouse fixture)
from tiny_models import tiny_hf_dir

from tidal.bench.step import StepBench
from tidal.config import ServerArgs, default_model_path
from tidal.model.forward_batch import ForwardMode
from tidal.model.packed import prepack_available

PROMPT_LENS = (23, 40, 9)  # ragged on purpose: batches of 2+ carry a padding mask


@pytest.fixture(scope="module", params=["float32", "bfloat16-prepacked"])
def bench(request, tmp_path_factory):
    """float32: the exact path; bfloat16 with oneDNN-prepacked weights: graph constants under inductor's
    freezing (tidal/model/compiled.py), the default on a CPU with native bfloat16. A tiny Llama (3 layers,
    hidden 128): the graphs are the real model's, minutes of compiling fewer."""
    dtype = request.param.split("-")[0]
    if "prepacked" in request.param and not prepack_available(torch.bfloat16):
        pytest.skip("oneDNN cannot reorder bfloat16 weights on this CPU (AVX2 only)")
    path = tiny_hf_dir(tmp_path_factory.mktemp("tiny-llama"), "LlamaConfig", num_hidden_layers=3,
                       hidden_size=128, intermediate_size=256, vocab_size=512)
    args = ServerArgs(model_path=path, dtype=dtype, device="cpu", page_size=16,
                      torch_threads=1, max_total_tokens=16 * 32, enable_torch_compile=True,
                      torch_compile_max_bs=2, weight_prepack="on" if "prepacked" in request.param else "off")
    sb = StepBench(args, max_batch=len(PROMPT_LENS), context=64)
    for row, n in enumerate(PROMPT_LENS):
        sb.run(sb.batch(ForwardMode.EXTEND, [(row, 0, n)]))
    return sb


def _decode_both(sb: StepBench, rows: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager and compiled logits of one decode pass (both store the same K/V in the same slots)."""
    fb = sb.batch(ForwardMode.DECODE, [(r, n, 1) for r, n in zip(rows, lens)])
    compiled = sb.runner.compiled
    try:
        sb.runner.compiled = None
        eager = sb.run(fb)
    finally:
        sb.runner.compiled = compiled
    fb.attn_metadata = None
    assert compiled.takes(fb) or len(rows) > compiled.max_bs
    return eager, sb.run(fb)


def test_compiled_decode_matches_eager_and_compiles_nothing_after_start(bench):
    from torch._dynamo.utils import counters

    assert bench.runner.compiled is not None
    graphs_at_start = counters["stats"]["unique_graphs"]
    lens = list(PROMPT_LENS)
    for step in range(4):  # contexts grow every step: dynamic lengths, no new graph
        for rows in ([0], [1], [0, 1], [2, 1]):
            eager, compiled = _decode_both(bench, rows, [lens[r] for r in rows])
            if bench.runner.dtype == torch.float32:
                torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
                assert torch.equal(compiled.argmax(-1), eager.argmax(-1)), (step, rows)
                continue
            # bfloat16 activations: fused kernels round at other points than eager ops; compiled's
            # top token is eager's or one eager scores within that rounding of its own top
            assert (compiled - eager).abs().max() < 1.0, (step, rows)  # logits ~20: a few bf16 ulps
            picked = eager.gather(1, compiled.argmax(-1, keepdim=True))[:, 0]
            assert (eager.max(-1).values - picked).max() < 0.5, (step, rows)
        for r in range(len(lens)):
            lens[r] += 1
    assert counters["stats"]["unique_graphs"] == graphs_at_start


def test_batches_over_the_limit_and_prefill_stay_eager(bench):
    compiled = bench.runner.compiled
    lens = [n + 8 for n in PROMPT_LENS]
    fb = bench.batch(ForwardMode.DECODE, [(r, n, 1) for r, n in enumerate(lens)])
    bench.runner.attn_backend.init_forward_metadata(fb)
    assert not compiled.takes(fb)  # 3 requests > --torch-compile-max-bs 2
    fb = bench.batch(ForwardMode.EXTEND, [(0, lens[0] + 1, 4)])
    bench.runner.attn_backend.init_forward_metadata(fb)
    assert not compiled.takes(fb)


def test_torch_compile_refuses_tensor_parallel():
    with pytest.raises(ValueError, match="--enable-torch-compile"):
        ServerArgs(enable_torch_compile=True, tp_size=2).validate()
    with pytest.raises(ValueError, match="--torch-compile-max-bs"):
        ServerArgs(enable_torch_compile=True, torch_compile_max_bs=0).validate()


@pytest.mark.slow  # a second compile in a server process (a minute); the in-process tests above cover the step
def test_compiled_server_returns_the_eager_servers_tokens():
    """A server with --enable-torch-compile (overlap scheduling on, the step in its worker thread)
    answers concurrent greedy requests with the same tokens as an eager server."""
    from tests.servers import Server, greedy_concurrently

    prompts = [[1, 504, 3458, 282, 260, 3458, 28, 198], [1, 4428, 314, 253, 7033, 30, 216],
               [1, 11741, 1326, 2717, 314, 2]]
    outputs = {}
    for name, extra in (("eager", ()), ("compiled", ("--enable-torch-compile", "--torch-compile-max-bs", "2"))):
        srv = Server("--torch-threads", "1", *extra)
        try:
            outputs[name] = greedy_concurrently(srv.url, prompts, 10)
        finally:
            assert srv.stop() == 0
    assert outputs["compiled"] == outputs["eager"]


def _inductor_error() -> Exception:
    from torch._inductor.exc import InductorError

    return InductorError(RuntimeError("C++ compile error (a test's)"), None)


def _eager_args(**kw) -> ServerArgs:
    return ServerArgs(model_path=default_model_path(), dtype="float32", device="cpu", page_size=16,
                      torch_threads=1, max_total_tokens=16 * 32, torch_compile_max_bs=2, **kw)


def _failing_warm_up(compiled, runner, context=16):
    raise _inductor_error()


def test_a_default_compile_that_fails_at_start_falls_back_to_eager(monkeypatch, caplog):
    import tidal.model.runner as runner_mod

    monkeypatch.setattr(runner_mod, "warm_up", _failing_warm_up)
    monkeypatch.delenv("TIDAL_TORCH_COMPILE_AUTO", raising=False)
    with caplog.at_level("WARNING", logger="tidal.model.runner"):
        sb = StepBench(_eager_args(), max_batch=1, context=16)  # enable_torch_compile None: the default
    assert sb.runner.compiled is None
    assert "did not compile" in caplog.text and "eager step" in caplog.text
    sb.run(sb.batch(ForwardMode.EXTEND, [(0, 0, 5)]))  # serves, eager


def test_an_asked_for_compile_that_fails_at_start_is_a_clear_error(monkeypatch):
    import tidal.model.runner as runner_mod

    monkeypatch.setattr(runner_mod, "warm_up", _failing_warm_up)
    with pytest.raises(RuntimeError, match="--enable-torch-compile: the decode step did not compile"):
        StepBench(_eager_args(enable_torch_compile=True), max_batch=1, context=16)


def test_a_compile_that_fails_mid_serve_turns_the_compiled_step_off_and_the_pass_runs_eager(monkeypatch, caplog):
    import tidal.model.runner as runner_mod

    monkeypatch.setattr(runner_mod, "warm_up", lambda compiled, runner, context=16: 0.0)  # nothing compiled yet
    sb = StepBench(_eager_args(enable_torch_compile=True), max_batch=1, context=16)
    sb.run(sb.batch(ForwardMode.EXTEND, [(0, 0, 5)]))
    fb = sb.batch(ForwardMode.DECODE, [(0, 5, 1)])
    compiled, sb.runner.compiled = sb.runner.compiled, None
    eager = sb.run(fb)
    sb.runner.compiled = compiled
    compiled._step = lambda fb: (_ for _ in ()).throw(_inductor_error())  # a graph that does not build
    fb.attn_metadata = None
    with caplog.at_level("ERROR", logger="tidal.model.runner"):
        logits = sb.run(fb)
    assert sb.runner.compiled is None and "runs eager from now on" in caplog.text
    torch.testing.assert_close(logits, eager)


def test_warm_up_builds_one_graph_per_batch_class_and_thread_count():
    from tidal.model.compiled import CompiledDecode

    compiled = CompiledDecode(torch.nn.Identity(), max_bs=32, quantized_max_tokens=8)
    assert compiled.warm_up_batch_sizes(one_thread_max_tokens=1) == [1, 2, 9]  # 1 thread | int4 | dense
    assert compiled.warm_up_batch_sizes(one_thread_max_tokens=4) == [1, 2, 5, 9]  # int4 on 1 and on 2 threads
    assert compiled.warm_up_batch_sizes(one_thread_max_tokens=0) == [1, 2, 9]
    assert CompiledDecode(torch.nn.Identity(), max_bs=4, quantized_max_tokens=0).warm_up_batch_sizes(8) == [1, 2]
