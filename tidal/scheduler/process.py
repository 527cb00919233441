"""The scheduler process: ZMQ in, one loop, ZMQ out.

With tensor parallelism there is one scheduler process per TP rank. Rank 0 reads the
API's messages and hands every rank the same list each iteration; every rank then runs
the same deterministic loop (KV polls and sampled tokens are agreed on through the
communicator), and only rank 0 answers the API. Any rank may report a fatal error.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import time
import traceback
from typing import Optional

import msgspec
import zmq

from tidal.config import ServerArgs
from tidal.leftovers import exit_now
from tidal.messages import (
    BatchOut,
    LoadSnapshot,
    SchedulerError,
    SchedulerReady,
    decode_to_scheduler,
    encode,
)

from tidal.scheduler.step_timing import now

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100
# nothing to run, but requests wait on another thread (a KV hand-off's bootstrap or transfer):
# their progress does not wake the poller, so look again soon
WAITING_POLL_MS = 1
LOAD_SNAPSHOT_INTERVAL_S = 0.2


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the API process dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class _Terminated(BaseException):
    """SIGTERM: raised wherever the rank is (a forward pass, a TP collective's wait, zmq poll)."""


def _on_sigterm(*_) -> None:
    raise _Terminated()


def run_scheduler_process(args: ServerArgs, recv_addr: str, send_addr: str, tp_rank: int = 0,
                          tp_comm_name: Optional[str] = None) -> None:
    """Runs until SIGTERM (exit 0, at once: see exit_now) or a fatal error (exit 1)."""
    _die_with_parent()
    who = "scheduler" if args.tp_size == 1 else f"scheduler TP{tp_rank}"
    logging.basicConfig(level=args.log_level.upper(), format=f"[%(asctime)s {who}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    signal.signal(signal.SIGTERM, _on_sigterm)
    cleanup: list = []
    try:
        _run(args, recv_addr, send_addr, tp_rank, tp_comm_name, who, cleanup)
    except _Terminated:
        logger.info("SIGTERM: stopping")
        _release(cleanup)
        exit_now(0)


def _release(cleanup: list) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a SIGTERM now must not interrupt the cleanup
    for step in reversed(cleanup):
        try:
            step()
        except Exception:
            logger.exception("cleanup step failed")


def _run(args: ServerArgs, recv_addr: str, send_addr: str, tp_rank: int, tp_comm_name: Optional[str],
         who: str, cleanup: list) -> None:
    """`cleanup` collects what SIGTERM must release, in the order it was acquired."""
    cpu_plan = take_cpus(args, tp_rank)  # first: threads started from now on inherit the affinity
    ctx = zmq.Context(1)
    cleanup.append(lambda: ctx.destroy(linger=0))
    recv = None
    if tp_rank == 0:
        recv = ctx.socket(zmq.PULL)
        recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    comm = None
    try:
        comm = make_comm(args, tp_rank, tp_comm_name)
        cleanup.append(comm.close)
        sched = build_scheduler(args, comm, cpu_plan)
        cleanup.append(sched.shutdown)
        affinities = [a.decode() for a in comm.all_gather_bytes(current_affinity().encode())]  # all ranks built
    except Exception as e:  # report why we could not start, then exit non-zero
        logger.error("scheduler failed to start: %s", e)
        if not _peer_aborted(e):  # the rank that failed reports; its peers only stop
            send.send(encode(SchedulerError(message=f"{who}: {type(e).__name__}: {e}\n{traceback.format_exc()}")))
        if comm is not None:
            comm.abort()
        send.close(linger=2000)
        _release(cleanup)
        exit_now(1)  # a SIGTERM during the interpreter's teardown would be lost in a __del__
    if tp_rank == 0:
        send.send(encode(ready_message(sched, affinities)))
    try:
        SchedulerLoop(sched, recv, send).run()
    except Exception as e:
        logger.exception("scheduler crashed")
        if not _peer_aborted(e):
            send.send(encode(SchedulerError(message=f"{who} crashed: {type(e).__name__}: {e}")))
        comm.abort()  # the other ranks' next collective fails at once instead of timing out
        send.close(linger=2000)
        _release(cleanup)
        exit_now(1)


def _peer_aborted(e: BaseException) -> bool:
    from tidal.parallel import PeerAborted

    return isinstance(e, PeerAborted)


def make_comm(args: ServerArgs, tp_rank: int, tp_comm_name: Optional[str]):
    from tidal.parallel import ShmComm, SingleRank

    if args.tp_size == 1:
        return SingleRank()
    if tp_comm_name is None:
        raise ValueError("--tp > 1 needs the launcher's shared communicator segment")
    return ShmComm(tp_comm_name, tp_rank, args.tp_size, timeout_s=args.watchdog_timeout)


def take_cpus(args: ServerArgs, tp_rank: int):
    """This rank's share of the CPUs its server may use; with --tp > 1 and enough physical
    cores, pins it to its own (unless --disable-cpu-pinning)."""
    from tidal.cpus import apply_plan, cgroup_cpu_limit, plan_member

    plan = plan_member(tp_rank, args.tp_size, pin=not args.disable_cpu_pinning, cpu_limit=cgroup_cpu_limit())
    apply_plan(plan)
    return plan


def current_affinity() -> str:
    from tidal.cpus import format_cpu_list, usable_cpus

    return format_cpu_list(usable_cpus())


def _log_cpus(runner, plan) -> None:
    import os

    import torch

    from tidal.cpus import cgroup_cpu_limit, physical_cores, usable_cpus

    cpus = usable_cpus()
    limit = cgroup_cpu_limit()
    logger.info("CPUs: %d torch threads (inter-op %d), affinity %s (%s), %d physical cores in %d CPUs, "
                "cgroup CPU limit %s, OMP_WAIT_POLICY=%s", runner.torch_threads, torch.get_num_interop_threads(),
                current_affinity(), "pinned" if plan and plan.cpus is not None else "inherited",
                len(physical_cores(cpus)), len(cpus), "none" if limit is None else f"{limit:g}",
                os.environ.get("OMP_WAIT_POLICY", "unset"))


def build_scheduler(args: ServerArgs, comm=None, cpu_plan=None):
    import torch

    from tidal.model.runner import ModelRunner
    from tidal.model.tokenizer import load_tokenizer
    from tidal.scheduler.scheduler import Scheduler

    try:
        torch.set_num_interop_threads(1)  # nothing here runs inter-op parallel work
    except RuntimeError:  # already set, or inter-op work already ran in this process
        pass
    runner = ModelRunner(args, comm, cpu_plan)
    _log_cpus(runner, cpu_plan)
    tokenizer = load_tokenizer(args.model_path, args.tokenizer_path)
    draft = None
    if args.speculative_algorithm == "STANDALONE":  # its KV pool has a slot for each of the target's
        draft = ModelRunner(args.replace(model_path=args.speculative_draft_model_path, tokenizer_path=None,
                                         max_total_tokens=runner.max_total_tokens, enable_lora=False,
                                         lora_paths=(), enable_torch_compile=False), comm, cpu_plan)
    return Scheduler(args, runner, tokenizer, draft_runner=draft)


def ready_message(sched, cpu_affinity: Optional[list[str]] = None) -> SchedulerReady:
    runner = sched.runner
    return SchedulerReady(
        max_total_tokens=sched.mem.max_total_tokens,
        max_running_requests=sched.max_running_requests,
        max_req_input_len=sched.max_req_input_len,
        context_length=sched.context_length,
        vocab_size=runner.model_config.vocab_size,
        page_size=sched.mem.page_size,
        device=str(runner.device),
        dtype=str(runner.dtype).replace("torch.", ""),
        quantization=runner.quantization,
        torch_threads=getattr(runner, "torch_threads", 0),
        cpu_affinity=list(cpu_affinity or []),
        pooling=sched.embedder.pooling.describe() if sched.embedder is not None else "",
        hidden_size=runner.model_config.hidden_size,
        lora_enabled=getattr(runner, "lora", None) is not None,
        lora_adapters=runner.lora.paths() if getattr(runner, "lora", None) is not None else {},
        kv_events=sched.kv_events.info() if sched.kv_events is not None else {},
    )


class SchedulerLoop:
    """recv is rank 0's socket from the API (None on other ranks)."""

    def __init__(self, sched, recv: Optional[zmq.Socket], send: zmq.Socket):
        self.sched = sched
        self.tp = sched.tp
        self.recv = recv
        self.send = send
        self.poller = zmq.Poller()
        self.snapshot_at = 0.0
        self.snapshot_role: tuple = ()  # (epoch, handing_over_from) of the last snapshot
        self.was_busy = True
        if recv is not None:
            self.poller.register(recv, zmq.POLLIN)

    def run(self) -> None:
        timing = self.sched.timing
        while True:
            t0 = now()
            for frame in self._inbox():
                self.sched.handle(decode_to_scheduler(frame))
            timing.add("recv", now() - t0)
            did_work = self.sched.step()
            t1 = now()
            self._flush(did_work)
            timing.add("send", now() - t1)
            timing.end_iteration(did_work, self.sched.last_batch_size)
            if not did_work:
                self._on_idle()

    def _inbox(self) -> list[bytes]:
        """This iteration's messages: what rank 0 read, the same on every rank."""
        frames = self._read_all() if self.recv is not None else []
        if self.tp.size == 1:
            return frames
        mine = _FRAMES.encode(frames) if self.tp.rank == 0 else None
        return _FRAMES_DECODER.decode(self.tp.broadcast_bytes(mine))

    def _read_all(self) -> list[bytes]:
        frames = []
        while True:
            try:
                frames.append(self.recv.recv(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def _flush(self, did_work: bool) -> None:
        outputs = self.sched.take_outbox()
        if self.tp.rank != 0:  # rank 0 answers for all ranks
            self.sched.take_replies()
            return
        if outputs:
            self.send.send(encode(BatchOut(outputs=outputs)))
        # before the replies: a switch's answer reaches its caller after the snapshot of the new role
        self._send_load_snapshot(did_work)
        for reply in self.sched.take_replies():
            self.send.send(encode(reply))

    def _send_load_snapshot(self, did_work: bool) -> None:
        """Every LOAD_SNAPSHOT_INTERVAL_S, and at once when the work runs out (the idle state
        is what a client checks after its requests ended) or the role changed (a switch, a handover's end: a
        router reads the role from /get_load as the switch answers)."""
        now = time.monotonic()
        went_idle, self.was_busy = self.was_busy and not did_work, did_work
        c = self.sched.controller
        role = (c.epoch, c.handing_over_from)
        if went_idle or role != self.snapshot_role or now - self.snapshot_at >= LOAD_SNAPSHOT_INTERVAL_S:
            self.snapshot_at, self.snapshot_role = now, role
            self.send.send(encode(LoadSnapshot(stats=self.sched.make_stats(0))))

    def _on_idle(self) -> None:
        idle = self.sched.is_idle()
        if self.sched.args.enable_integrity_check and idle:
            self.sched.check_integrity()
        if self.recv is not None:  # other ranks wait for rank 0 in the next broadcast
            self.poller.poll(idle_poll_ms(idle))


def idle_poll_ms(scheduler_idle: bool) -> int:
    """How long a loop iteration that ran nothing waits for new messages."""
    return IDLE_POLL_MS if scheduler_idle else WAITING_POLL_MS


_FRAMES = msgspec.msgpack.Encoder()
_FRAMES_DECODER = msgspec.msgpack.Decoder(list[bytes])
