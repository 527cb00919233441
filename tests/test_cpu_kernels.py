"""Prepacked oneDNN linears (tidal/model/packed.py) and the CPU-driven kernel choice (tidal/model/cpu_kernels.py)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from tidal.model.cpu_kernels import CpuKind, choose_kernels, detect_cpu
from tidal.model.packed import PackedLinear, linear_without_bias, prepack_available, prepack_model
from tidal.model.quant import Int4Linear, Int4Weight, Int8Linear

needs_onednn = pytest.mark.skipif(not prepack_available(), reason="this torch has no oneDNN linear ops")
# oneDNN reorders bfloat16 weights only with AVX512BW/VL/DQ or AVX-NE-CONVERT (not on AVX2-only CPUs)
needs_bf16_reorder = pytest.mark.skipif(not prepack_available(torch.bfloat16),
                                        reason="oneDNN cannot reorder bfloat16 weights on this CPU")
CPU = torch.device("cpu")
AMX = CpuKind("AMX", True, ("amx_bf16", "avx512_bf16", "avx512f"))
AVX512_BF16 = CpuKind("AVX512", True, ("avx512_bf16", "avx512f"))
AVX2 = CpuKind("AVX2", False, ("avx2", "fma"))


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2, marks=needs_bf16_reorder)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_linear_equals_f_linear(dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    lin = PackedLinear(w, b)
    ref = F.linear(x.float(), w.float(), b.float())
    out = lin(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()
    assert (linear_without_bias(lin, x).float() - (ref - b.float())).abs().max() <= tol * ref.abs().max()
    assert lin(x[None]).shape == (1, rows, 96)  # leading dims kept


@needs_onednn
@needs_bf16_reorder
def test_prepack_model_swaps_linears_and_packs_the_quantized_layers_dense_copies():
    g = torch.Generator().manual_seed(0)
    w4 = Int4Weight(torch.randint(0, 16, (64, 64), dtype=torch.uint8, generator=g),
                    torch.rand(64, 2, generator=g) * 0.05, torch.zeros(64, 2))
    dense = w4.dequantize().to(torch.bfloat16)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16),
                                Int4Linear(w4, None, dense.clone(), max_quant_tokens=2),
                                Int8Linear(dense.clone(), None, max_quant_tokens=2, keep_dense=True),
                                Int4Linear(w4, None, None, max_quant_tokens=0))  # no dense copy: untouched
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        before = [model[0](x), model[1](x), model[2](x), model[1](x[:2]), model[3](x)]
        assert prepack_model(model) == 3
        assert isinstance(model[0], PackedLinear)
        assert model[1].dense is None and model[1].dense_packed is not None and model[3].dense_packed is None
        after = [model[0](x), model[1](x), model[2](x), model[1](x[:2]), model[3](x)]
    for b, a in zip(before, after):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
    torch.testing.assert_close(after[3], before[3], rtol=0, atol=0)  # 2 rows: still the int4 kernel
    torch.testing.assert_close(after[4], before[4], rtol=0, atol=0)


def test_auto_prepacks_bf16_on_native_bf16_cpus_only_and_says_why():
    bf16, f32 = torch.bfloat16, torch.float32
    for cpu in (AMX, AVX512_BF16):
        k = choose_kernels("auto", CPU, bf16, cpu)
        assert k.weight_prepack == prepack_available(bf16)
        assert cpu.isa in k.reason or not prepack_available(bf16)
    k = choose_kernels("auto", CPU, bf16, AVX2)
    assert not k.weight_prepack and "no native bfloat16" in k.reason
    k = choose_kernels("auto", CPU, f32, AMX)
    assert not k.weight_prepack and "float32" in k.reason
    assert not choose_kernels("auto", torch.device("cuda"), bf16, AMX).weight_prepack
    assert not choose_kernels("off", CPU, bf16, AMX).weight_prepack  # explicit flags win


def test_explicit_prepack_that_cannot_run_is_a_clear_error():
    with pytest.raises(ValueError, match="--weight-prepack on: it packs CPU weights only"):
        choose_kernels("on", torch.device("cuda"), torch.bfloat16, AMX)
    with pytest.raises(ValueError, match="--weight-prepack must be one of"):
        choose_kernels("yes", CPU, torch.bfloat16, AMX)


def test_prepack_where_this_cpu_cannot_reorder_the_dtype_is_an_error_when_asked_and_off_by_default(monkeypatch):
    import tidal.model.packed as packed

    monkeypatch.setattr(packed, "_reorders", lambda dtype: dtype != torch.bfloat16)  # an AVX2-only CPU
    with pytest.raises(ValueError, match="--weight-prepack on: oneDNN cannot reorder bfloat16 weights on this CPU"):
        choose_kernels("on", CPU, torch.bfloat16, AVX2)
    k = choose_kernels("auto", CPU, torch.bfloat16, AVX512_BF16)
    assert not k.weight_prepack and "cannot reorder bfloat16" in k.reason
    if prepack_available():
        assert choose_kernels("on", CPU, torch.float32, AVX2).weight_prepack


def test_detect_cpu_reads_this_machine_and_the_choice_is_logged(caplog):
    cpu = detect_cpu()
    assert cpu.isa and isinstance(cpu.native_bf16, bool)
    with caplog.at_level(logging.INFO, logger="tidal.model.cpu_kernels"):
        choose_kernels("auto", CPU, torch.bfloat16, cpu).log(cpu)
    assert "CPU: " + cpu.isa in caplog.text and "weight prepack" in caplog.text


def _runner(dtype: str, prepack: str):
    from tidal.config import ServerArgs, default_model_path
    from tidal.model.runner import ModelRunner

    return ModelRunner(ServerArgs(model_path=default_model_path(), dtype=dtype, device="cpu", quantization="none",
                                  max_total_tokens=512, page_size=16, torch_threads=1, weight_prepack=prepack))


def _prefill_logits(runner, ids: list[int]) -> torch.Tensor:
    from tidal.model.forward_batch import ForwardBatch, ForwardMode

    n, dev = len(ids), torch.device("cpu")
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    slots = list(range(16, 16 + n))  # page 0 is the dummy page
    r2t = torch.zeros(1, 64, dtype=torch.int64)
    r2t[0, :n] = t(slots)
    fb = ForwardBatch(ForwardMode.EXTEND, input_ids=t(ids), positions=t(list(range(n))), out_cache_loc=t(slots),
                      req_pool_indices=t([0]), seq_lens=t([n]), extend_prefix_lens=t([0]), extend_seq_lens=t([n]),
                      req_to_token=r2t, kv_pool=runner.kv_pool, seq_lens_cpu=[n], extend_prefix_lens_cpu=[0],
                      extend_seq_lens_cpu=[n])
    return runner.forward(fb, torch.arange(n))


@needs_onednn
def test_the_prepacked_model_gives_the_plain_models_logits():
    """The whole model (tied LM head included) prepacked: float32 equal to 1e-4, bfloat16 within its rounding."""
    ids = [1, 504, 3458, 7586, 11330, 314, 260, 2613, 30, 2]
    cases = (("float32", 1e-4), ("bfloat16", 0.35)) if prepack_available(torch.bfloat16) else (("float32", 1e-4),)
    for dtype, tol in cases:
        plain, packed = _runner(dtype, "off"), _runner(dtype, "on")
        assert packed.kernels.weight_prepack and isinstance(packed.model.lm_head, PackedLinear)
        a, b = _prefill_logits(plain, ids), _prefill_logits(packed, ids)
        assert (a - b).abs().max() < tol, dtype
        assert torch.equal(a.argmax(-1), b.argmax(-1)), dtype


def test_compile_is_on_by_default_where_it_runs_and_says_why_not_elsewhere(monkeypatch):
    from tidal.model.cpu_kernels import choose_compile

    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    env: dict[str, str] = {}
    assert choose_compile(None, CPU, 1, False, "torch", environ=env)[0]
    for args, why in (((CPU, 2, False, "torch"), "--tp > 1"), ((CPU, 1, True, "torch"), "LoRA"),
                      ((CPU, 1, False, "flex"), "flex attention backend"),
                      ((torch.device("cuda"), 1, False, "torch"), "cuda")):
        on, reason = choose_compile(None, *args, environ=env)
        assert not on and why in reason
    on, reason = choose_compile(None, CPU, 1, False, "torch", speculative=True, environ=env)
    assert not on and "speculative" in reason
    assert choose_compile(None, CPU, 1, False, "torch", environ={"TIDAL_TORCH_COMPILE_AUTO": "off"}) == \
        (False, "off by default here (TIDAL_TORCH_COMPILE_AUTO=off)")
    assert choose_compile(True, CPU, 1, False, "torch", environ={"TIDAL_TORCH_COMPILE_AUTO": "off"})[0]
    assert not choose_compile(False, CPU, 1, False, "torch", environ=env)[0]
    monkeypatch.setattr("shutil.which", lambda name: None)
    on, reason = choose_compile(None, CPU, 1, False, "torch", environ=env)
    assert not on and "no C++ compiler" in reason


def test_the_compile_flags_parse_to_on_off_and_auto():
    import argparse

    from tidal.config import add_server_args, server_args_from_namespace

    def parse(*argv: str):
        p = argparse.ArgumentParser()
        add_server_args(p)
        return server_args_from_namespace(p.parse_args(["--model-path", "/m.gguf", *argv]))

    assert parse().enable_torch_compile is None
    assert parse("--enable-torch-compile").enable_torch_compile is True
    assert parse("--disable-torch-compile").enable_torch_compile is False
    assert parse("--weight-prepack", "off").weight_prepack == "off"
