"""The decode step compiled with torch.compile (`--enable-torch-compile`, the default where it runs).

A decode step of a small model is hundreds of tiny eager ops (norms, RoPE, casts around the
quantized matmuls, K/V store and gather, residual adds): on CPU their dispatch costs as much as
the matmuls. Inductor fuses the elementwise ones into generated C++ loops and runs the step as
one Python call. Only DECODE passes of at most `max_bs` requests take the compiled step;
prefill (ragged, one attention call per request) and larger batches stay eager.

Shapes are dynamic (batch and context length are symbols), so a server compiles a handful of
graphs at start-up, not one per (batch, length): batch 1 (torch specialises size 1), batches
2..quantized-max-tokens (int4 kernels) and larger ones up to max_bs (dense weights). Every
batch of two or more requests carries a padding mask, so uniform and ragged batches share a
graph. The thread count is part of a graph's key (a dynamo guard), so where passes of up to
`--one-thread-max-tokens` tokens run on one thread the warm-up compiles those graphs on one thread
too. The graphs are cached on disk by inductor (TORCHINDUCTOR_CACHE_DIR), so a restart with
the same model and flags compiles much faster than the first start (tidal keeps that cache under
~/.cache/tidal/inductor unless TORCHINDUCTOR_CACHE_DIR says otherwise).

The graphs compile with inductor's freezing on: weights are constants of the graph, so oneDNN
prepacked weights (tidal/model/packed.py) run inside it and plain bfloat16 ones get prepacked by
inductor. On by default where it runs (tidal/model/cpu_kernels.py `choose_compile`).

A compile that fails is never a crash mid-serve: at start (the warm-up) the runner stops with a clear
error when the compile was asked for and falls back to the eager step with a warning when it was
the default; a later compile that fails (a graph the warm-up did not build) turns the compiled step
off for the server's life and that pass runs eager (its K/V are rewritten into the same slots).
"""

from __future__ import annotations

import logging
import time

import torch

from tidal.model.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


# freezing: see CompiledDecode. cpp.dynamic_threads: the generated loops ask OpenMP for the thread
# count at each call (else it is fixed when compiled, unless it equals os.cpu_count()), so a small
# pass's one thread (tidal/model/runner.py PassThreads) holds inside the graph too.
INDUCTOR_CONFIG = {"freezing": True, "cpp.dynamic_threads": True}


class _DecodeLogits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model.model(fb))


class CompiledDecode:
    """model.compute_logits(model.model(fb)) for DECODE batches of <= max_bs requests, compiled."""

    def __init__(self, model: torch.nn.Module, max_bs: int, quantized_max_tokens: int):
        import torch._dynamo

        # one graph per (batch class, mask or not, quantized or dense); the default limit of 8 is
        # shared by all, and a miss falls back to eager silently: leave room
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        self.model, self.max_bs = model, max_bs
        self.quantized_max_tokens = quantized_max_tokens
        # freezing: the weights become graph constants, which inductor's oneDNN linears need for
        # prepacked weights (tidal/model/packed.py). It must be inductor's config while a graph compiles
        # (torch.compile's options= did not reach it in torch 2.13), and compiles happen at calls.
        self._step = torch.compile(_DecodeLogits(model), dynamic=True)

    def takes(self, fb: ForwardBatch) -> bool:
        meta = fb.attn_metadata
        return (fb.forward_mode == ForwardMode.DECODE and fb.batch_size <= self.max_bs
                and getattr(meta, "bag", None) is None)

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits [B, V], one row per request (a decode pass's every row)."""
        with torch._inductor.config.patch(INDUCTOR_CONFIG):
            return self._step(fb)

    def warm_up_batch_sizes(self, one_thread_max_tokens: int = 0) -> list[int]:
        """One batch size per graph the server will need (see the module docstring); passes of at most
        one_thread_max_tokens run on one thread, and the thread count is part of a graph's key."""
        sizes = [1, 2, one_thread_max_tokens + 1]
        if self.quantized_max_tokens:
            sizes.append(self.quantized_max_tokens + 1)
        return sorted({b for b in sizes if b <= self.max_bs})


def compile_failure(exc: BaseException) -> bool:
    """True for the errors torch.compile raises when a graph cannot be built (dynamo, inductor, the C++ build)."""
    import torch._dynamo.exc
    import torch._inductor.exc

    return isinstance(exc, (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.CppCompileError))


def warm_up(compiled: CompiledDecode, runner, context: int = 16) -> float:
    """Compiles every graph now, on dummy requests in the KV pool's dummy page; returns seconds.

    Each dummy request sees `context` tokens, all in slots of page 0 (never handed to a real
    request, and written by padding anyway), so nothing a live request owns is touched.
    """
    t0 = time.perf_counter()
    dev = runner.kv_pool.device
    for bs in compiled.warm_up_batch_sizes(runner.pass_threads.one_thread_max_tokens):
        # ragged lengths for bs > 1: the masked graph, as live batches mostly are
        lens = [context - (i % 2) for i in range(bs)]
        fb = dummy_decode_batch(runner, lens, dev)
        t1 = time.perf_counter()
        with torch.inference_mode():
            # the thread count is one of dynamo's guards: compile each graph under the count its
            # passes run with (tidal/model/runner.py PassThreads), or the first live pass recompiles
            runner.pass_threads.set_for(bs)
            runner.attn_backend.init_forward_metadata(fb)
            compiled(fb)
        logger.info("torch.compile: decode graph for batch %d (%d torch thread%s) ready in %.1f s", bs,
                    torch.get_num_threads(), "" if torch.get_num_threads() == 1 else "s", time.perf_counter() - t1)
    runner.pass_threads.set_for(runner.pass_threads.one_thread_max_tokens + 1)
    return time.perf_counter() - t0


def dummy_decode_batch(runner, seq_lens: list[int], dev: torch.device) -> ForwardBatch:
    bs, max_len = len(seq_lens), max(seq_lens)
    prefix = [n - 1 for n in seq_lens]  # the new token's position: each request's last

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    zeros = [0] * bs
    return ForwardBatch(
        ForwardMode.DECODE, input_ids=t(zeros), positions=t(prefix), out_cache_loc=t(zeros),
        req_pool_indices=t(list(range(bs))), seq_lens=t(seq_lens), extend_prefix_lens=t(prefix),
        extend_seq_lens=t([1] * bs),
        req_to_token=torch.zeros(bs, max_len, dtype=torch.int64, device=dev),  # every slot: 0
        kv_pool=runner.kv_pool, seq_lens_cpu=list(seq_lens), extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=[1] * bs)
