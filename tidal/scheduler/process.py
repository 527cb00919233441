"""The scheduler process: ZMQ in, one loop, ZMQ out."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback

import zmq

from tidal.config import ServerArgs
from tidal.messages import (
    BatchOut,
    SchedulerError,
    SchedulerReady,
    decode_to_scheduler,
    encode,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the API process dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def run_scheduler_process(args: ServerArgs, recv_addr: str, send_addr: str) -> None:
    _die_with_parent()
    logging.basicConfig(
        level=args.log_level.upper(), format="[%(asctime)s scheduler] %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context(1)
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    try:
        sched = build_scheduler(args)
    except Exception as e:  # report why we could not start, then exit non-zero
        logger.error("scheduler failed to start: %s", e)
        send.send(encode(SchedulerError(message=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        send.close(linger=2000)
        sys.exit(1)
    send.send(encode(ready_message(sched)))
    try:
        SchedulerLoop(sched, recv, send).run()
    except Exception as e:
        logger.exception("scheduler crashed")
        send.send(encode(SchedulerError(message=f"scheduler crashed: {type(e).__name__}: {e}")))
        send.close(linger=2000)
        sched.shutdown()
        os._exit(1)
    finally:  # SIGTERM arrives as SystemExit: release sockets, threads, shared memory
        sched.shutdown()


def build_scheduler(args: ServerArgs):
    from tidal.model.runner import ModelRunner
    from tidal.model.tokenizer import load_tokenizer
    from tidal.scheduler.scheduler import Scheduler

    runner = ModelRunner(args)
    tokenizer = load_tokenizer(args.model_path, args.tokenizer_path)
    return Scheduler(args, runner, tokenizer)


def ready_message(sched) -> SchedulerReady:
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
    )


class SchedulerLoop:
    def __init__(self, sched, recv: zmq.Socket, send: zmq.Socket):
        self.sched = sched
        self.recv = recv
        self.send = send
        self.poller = zmq.Poller()
        self.poller.register(recv, zmq.POLLIN)

    def run(self) -> None:
        while True:
            self._drain_inbox()
            did_work = self.sched.step()
            self._flush()
            if not did_work:
                self._on_idle()

    def _drain_inbox(self) -> None:
        while True:
            try:
                data = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.sched.handle(decode_to_scheduler(data))

    def _flush(self) -> None:
        outputs = self.sched.take_outbox()
        if outputs:
            self.send.send(encode(BatchOut(outputs=outputs)))
        for reply in self.sched.take_replies():
            self.send.send(encode(reply))

    def _on_idle(self) -> None:
        if self.sched.args.enable_integrity_check and self.sched.is_idle():
            self.sched.check_integrity()
        self.poller.poll(IDLE_POLL_MS)
