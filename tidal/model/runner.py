"""ModelRunner: device/dtype choice, model loading, KV pool sizing, and the forward call."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from tidal.config import SWA_FULL_TOKENS_RATIO, ServerArgs
from tidal.cpus import CpuPlan, cgroup_cpu_limit, plan_member
from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.kvcache.swa import SWALayout
from tidal.model.attn_backend import create_attention_backend
from tidal.model.compiled import CompiledDecode, compile_failure, warm_up
from tidal.model.cpu_kernels import CpuKind, choose_compile, choose_kernels, detect_cpu
from tidal.model.forward_batch import ForwardBatch
from tidal.model.loader import load_model, resolve_model_path
from tidal.model.quant import resolve_quantization
from tidal.leftovers import owned_segment_name

logger = logging.getLogger(__name__)

# KV pool ceiling on CPU: the pool is zero-filled up front, so an oversized one costs RAM for nothing.
CPU_MAX_TOTAL_TOKENS = 1 << 20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, cpu: Optional[CpuKind] = None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    # CPU: float32 unless the CPU has native bf16 matmul (AMX / AVX512-BF16). Measured once on an
    # AVX2-only AMD EPYC, 2 threads, SmolLM2-135M decode step at context 256 (float32 vs bfloat16):
    # batch 1: 67 vs 51 ms, batch 8: 130 vs 157 ms, batch 32: 283 vs 623 ms. bf16 only wins the
    # weight-bandwidth-bound batch-1 case; without native bf16 instructions its matmuls are
    # emulated and lose badly once a batch makes them compute-bound. float32 also matches HF exactly.
    return torch.bfloat16 if (cpu or detect_cpu()).native_bf16 else torch.float32


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class PassThreads:
    """The torch threads each forward pass runs on: one for a pass of at most `one_thread_max_tokens`
    tokens, else all `threads`.

    A small pass is hundreds of short ops; each wakes the sleeping OpenMP workers (tidal runs them
    passive: spinning ones take the core from the API process) and waits for them, which costs more
    than their share of the work (docs/benchmarks.md section 29). Set in the thread that runs the
    pass: OpenMP's thread count is per calling thread.
    """

    def __init__(self, threads: int, one_thread_max_tokens: int):
        self.threads, self.one_thread_max_tokens = threads, one_thread_max_tokens

    def set_for(self, num_tokens: int) -> None:
        want = 1 if num_tokens <= self.one_thread_max_tokens else self.threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


class ModelRunner:
    def __init__(self, args: ServerArgs, tp=None, cpu_plan: Optional[CpuPlan] = None):
        """cpu_plan: this rank's share of the CPUs (default: computed here, without pinning)."""
        from tidal.parallel import SingleRank

        self.args = args
        self.tp = tp or SingleRank()
        self.device = resolve_device(args.device)
        self.cpu = detect_cpu()
        self.dtype = resolve_dtype(args.dtype, self.device, self.cpu)
        self.page_size = args.page_size
        plan = cpu_plan or plan_member(self.tp.rank, self.tp.size, pin=False, cpu_limit=cgroup_cpu_limit())
        self.torch_threads = args.torch_threads or plan.threads
        torch.set_num_threads(self.torch_threads)
        self.pass_threads = PassThreads(self.torch_threads,
                                        args.one_thread_max_tokens if self.device.type == "cpu" else 0)
        self.attn_backend = create_attention_backend(args.attention_backend, self.device)
        self.quantization = resolve_quantization(args.quantization, resolve_model_path(args.model_path)[0],
                                                 args.dtype, self.device, self.tp.size)
        self.kernels = choose_kernels(args.weight_prepack, self.device, self.dtype, self.cpu)
        if self.tp.rank == 0:
            self.kernels.log(self.cpu)
        self.model, self.model_config = load_model(
            args.model_path, self.dtype, self.device, self.attn_backend, args.context_length, tp=self.tp,
            quantization=self.quantization, max_quant_tokens=args.quantized_max_tokens,
            prepack=self.kernels.weight_prepack)
        self.lora = self._load_lora() if args.enable_lora else None
        self.swa_layers, self.swa_ratio = self._swa_plan()
        # every rank must hold the same number of KV slots: the schedulers make the same decisions
        self.max_total_tokens = int(self.tp.all_gather_ints([self._pool_size()]).min())
        cfg = self.model_config
        self.swa_size = self._swa_size() if self.swa_layers else 0
        self.num_kv_heads = self.model.shard.num_kv_heads  # this rank's
        # the shm transfer backend writes into a decode pool in shared memory; any role may
        # become decode at runtime, so the pool is shared whenever that backend is chosen
        shm = args.disaggregation_transfer_backend == "shm" and self.device.type == "cpu"
        self.kv_pool = MHATokenToKVPool(
            self.max_total_tokens, self.page_size, self.dtype,
            cfg.num_layers, self.num_kv_heads, cfg.head_dim, self.device,
            shm_name=owned_segment_name("kv") if shm else None,  # swept if this rank dies unclean
            swa_layers=self.swa_layers, swa_size=self.swa_size)
        if self.swa_layers and self.tp.rank == 0:
            logger.info("sliding-window layers %s: a KV pool of their own, %d tokens (--swa-full-tokens-ratio %.2f "
                        "of %d), pages freed past the window", sorted(self.swa_layers), self.swa_size,
                        self.swa_ratio, self.max_total_tokens)
        compile_on, why = choose_compile(args.enable_torch_compile, self.device, self.tp.size, args.enable_lora,
                                         self.attn_backend.name, bool(args.speculative_algorithm))
        if self.tp.rank == 0:
            logger.info("kernels: compiled decode step %s", why)
        self.compiled = self._compile_decode(asked=args.enable_torch_compile is True) if compile_on else None
        logger.info("model %s: %s on %s, quantization %s, KV pool %d tokens%s", args.model_path, self.dtype,
                    self.device, self.quantization, self.max_total_tokens, f", TP rank {self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else "")

    def _load_lora(self):
        from tidal.model.lora import LoRAManager

        return LoRAManager.from_args(self.args, self.model, self.dtype, self.device)

    def _compile_decode(self, asked: bool) -> Optional[CompiledDecode]:
        """The compiled step, warmed up; None (eager, with a warning) when the default's compile fails."""
        compiled = CompiledDecode(self.model, self.args.torch_compile_max_bs,
                                  self.args.quantized_max_tokens if self.quantization != "none" else 0)
        self.attn_backend.mask_every_batch = True
        logger.info("torch.compile: compiling the decode step for batches of up to %d requests "
                    "(minutes on a small CPU the first time; cached on disk after)", compiled.max_bs)
        try:
            seconds = warm_up(compiled, self)
        except Exception as e:
            if not compile_failure(e):
                raise
            self.attn_backend.mask_every_batch = False
            if asked:
                raise RuntimeError(f"--enable-torch-compile: the decode step did not compile ({_first_line(e)}); "
                                   "serve without it (--disable-torch-compile)") from e
            logger.warning("torch.compile: the decode step did not compile (%s); serving with the eager step "
                           "(--disable-torch-compile skips the attempt)", _first_line(e))
            return None
        logger.info("torch.compile: decode step compiled in %.1f s", seconds)
        return compiled

    def _compiled_logits(self, fb: ForwardBatch) -> Optional[torch.Tensor]:
        """The compiled step's logits, or None when its compile fails (the step is then off for good)."""
        try:
            return self.compiled(fb)
        except Exception as e:
            if not compile_failure(e):
                raise
            logger.error("torch.compile: a decode graph for batch %d did not compile (%s); the decode step "
                         "runs eager from now on", fb.batch_size, _first_line(e))
            self.compiled = None
            self.attn_backend.mask_every_batch = False
            return None

    def _swa_plan(self) -> tuple[frozenset[int], float]:
        """The windowed layers that get a KV pool of their own (tidal/kvcache/swa.py), and its size
        per full-pool token; (empty, 1.0) for one pool."""
        windowed = frozenset(i for i, w in enumerate(self.model_config.layer_windows) if w is not None)
        if not windowed:
            return frozenset(), 1.0
        refusal = self.args.swa_pool_refusal()
        ratio = self.args.swa_full_tokens_ratio
        if ratio is None:
            ratio = 1.0 if refusal else SWA_FULL_TOKENS_RATIO
        if ratio >= 1.0:
            logger.info("sliding-window layers share the full KV pool (%s)", refusal or "--swa-full-tokens-ratio 1")
            return frozenset(), 1.0
        return windowed, ratio

    def _swa_size(self) -> int:
        """The windowed buffers' slots: the ratio of the full pool's, and never fewer than one request's
        longest pass (a chunk, or a whole prompt without chunking) plus its window needs."""
        ps, window = self.page_size, self.swa_window
        chunk = self.args.chunked_prefill_size if self.args.chunked_prefill_size > 0 else self.model_config.context_length
        floor = min(self.max_total_tokens, chunk + window + 2 * ps)
        return max(int(self.swa_ratio * self.max_total_tokens), floor) // ps * ps

    @property
    def swa_layout(self) -> Optional[SWALayout]:
        """What the scheduler's allocator needs of the windowed buffers; None with one pool."""
        if not self.swa_layers:
            return None
        return SWALayout(self.swa_window, self.swa_size, self.kv_pool.swa_page_map)

    @property
    def swa_window(self) -> int:
        """The largest window of the model's layers: how far back any query looks (0: none windowed)."""
        return max((w for w in self.model_config.layer_windows if w is not None), default=0)

    def _pool_size(self) -> int:
        cfg = self.model_config
        if self.args.max_total_tokens:
            tokens = int(self.args.max_total_tokens)
        else:
            bpt = MHATokenToKVPool.bytes_per_token_for(1, self.model.shard.num_kv_heads, cfg.head_dim, self.dtype)
            # a windowed layer's buffer holds swa_ratio slots per full-pool slot
            per_token = bpt * (cfg.num_layers - len(self.swa_layers) + self.swa_ratio * len(self.swa_layers))
            # ranks on one host share its memory: each takes its share of the fraction
            per_token *= self.tp.size
            # the weights are already resident, so free memory is what is left after them
            tokens = int(self.args.mem_fraction_static * _free_memory_bytes(self.device) / per_token)
            if self.device.type == "cpu":
                tokens = min(tokens, CPU_MAX_TOTAL_TOKENS)
        tokens = tokens // self.page_size * self.page_size
        if tokens <= 0:
            raise RuntimeError("no memory left for the KV cache: raise --mem-fraction-static or set --max-total-tokens")
        return tokens

    def forward(self, fb: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Runs the pass (storing the new tokens' KV) and returns float32 logits [N, V] of rows logit_rows of T."""
        with torch.inference_mode():
            self.pass_threads.set_for(fb.input_ids.shape[0])
            self._prepare(fb)
            if self.compiled is not None and self.compiled.takes(fb):
                logits = self._compiled_logits(fb)
                if logits is not None:
                    return logits[logit_rows]
            hidden = self.model(fb)  # [T, hidden]
            return self.model.compute_logits(hidden[logit_rows])

    def forward_with_hidden(self, fb: ForwardBatch, logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, eager, also returning every row's hidden state [T, hidden] (the final norm's output)."""
        with torch.inference_mode():
            self.pass_threads.set_for(fb.input_ids.shape[0])
            self._prepare(fb)
            hidden = self.model(fb)
            return self.model.compute_logits(hidden[logit_rows]), hidden

    def _prepare(self, fb: ForwardBatch) -> None:
        """Attention metadata and the pass's LoRA adapters (none: the base model)."""
        self.attn_backend.init_forward_metadata(fb)
        if self.lora is not None:
            self.lora.begin(None if fb.lora_names is None else self.lora.prepare(fb.lora_names, fb.extend_seq_lens_cpu))
