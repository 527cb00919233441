"""Start one tidal server: the scheduler process, the ZMQ link, and uvicorn.

The API process binds both sockets (`ipc://` paths in a private temp dir), spawns the
scheduler, waits for SchedulerReady, then serves HTTP. Shutdown (SIGINT/SIGTERM, or
the scheduler dying) always ends with the child terminated and the temp dir removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import uvicorn
import zmq
import zmq.asyncio

from tidal.config import ServerArgs
from tidal.cpus import set_server_env
from tidal.http_timeout import h11_with_read_timeout
from tidal.leftovers import sweep_stale_segments
from tidal.messages import SchedulerError, SchedulerReady, decode_to_api
from tidal.server.app import ServerContext, create_app
from tidal.server.metrics import Metrics
from tidal.server.tokenizer_manager import TokenizerManager, load_server_tokenizer

logger = logging.getLogger(__name__)

START_TIMEOUT_S = float(os.environ.get("TIDAL_SCHEDULER_START_TIMEOUT", "900"))
CHILD_STOP_TIMEOUT_S = 5.0
GRACEFUL_SHUTDOWN_S = 5.0
DEATH_EXIT_DELAY_S = 1.0  # lets the 503 answers reach the clients before uvicorn stops


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture (it re-raises the signal after shutdown,
    which would kill this process before the scheduler is stopped)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


@dataclass
class _Control:
    signum: Optional[int] = None
    server: Optional[_Server] = None
    scheduler_died: bool = False

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.signum is not None and self.server is not None:
            self.server.force_exit = True  # second signal: stop waiting for connections
        self.signum = signum
        if self.server is not None:
            self.server.should_exit = True


def _default_target() -> Callable:
    from tidal.scheduler.process import run_scheduler_process

    return run_scheduler_process


def launch_server(args: ServerArgs, scheduler_target: Optional[Callable] = None) -> int:
    """Run a server until SIGINT/SIGTERM or the scheduler's death; returns the exit status."""
    set_server_env()  # before the scheduler processes start (they inherit it) and torch loads here
    target = scheduler_target or _default_target()
    args = args.with_bootstrap_key()  # one per server: every TP rank gets the same
    port_error = _port_unavailable(args.host, args.port)
    if port_error:  # before the scheduler spends minutes loading a model
        print(f"tidal: cannot listen on {args.host}:{args.port}: {port_error}", file=sys.stderr, flush=True)
        return 1
    sweep_stale_segments()  # left by tidal processes on this host that were killed
    control = _Control()
    old = {s: signal.signal(s, control.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    tmpdir = tempfile.mkdtemp(prefix="tidal-")
    proc: list = []
    try:
        return asyncio.run(_main(args, target, control, tmpdir, proc))
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        return e.code if isinstance(e.code, int) and e.code else 1
    finally:
        if proc:
            proc[0].stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def _port_unavailable(host: str, port: int) -> Optional[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            sock.bind(infos[0][4])
    except OSError as e:
        return str(e)
    return None


class SchedulerProcs:
    """The scheduler processes, one per TP rank; alive only while every one of them is.
    With TP > 1 it owns the ranks' shared communicator segment."""

    def __init__(self, target: Callable, args: ServerArgs, to_addr: str, from_addr: str):
        from tidal.parallel import create_segment

        self.comm_name = create_segment(args.tp_size) if args.tp_size > 1 else None
        self.procs: list[multiprocessing.Process] = []
        ctx = multiprocessing.get_context("spawn")
        # The children inherit an ignored SIGINT (and Python keeps it ignored), so a terminal
        # Ctrl-C reaches only this process, which then stops the children in order.
        prev = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._start(target, args, to_addr, from_addr, ctx)
        except BaseException:
            self.stop()  # the ranks already started and the segment
            raise
        finally:
            signal.signal(signal.SIGINT, prev)

    def _start(self, target: Callable, args: ServerArgs, to_addr: str, from_addr: str, ctx) -> None:
        for rank in range(args.tp_size):
            extra = () if self.comm_name is None else (rank, self.comm_name)
            name = "tidal-scheduler" if args.tp_size == 1 else f"tidal-scheduler-tp{rank}"
            proc = ctx.Process(target=target, args=(args, to_addr, from_addr, *extra), name=name)
            proc.start()
            self.procs.append(proc)
            logger.info("%s started (pid %d)", name, proc.pid)

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    @property
    def exitcode(self) -> Optional[int]:
        codes = [p.exitcode for p in self.procs if p.exitcode is not None]
        return codes[0] if codes else None

    def stop(self) -> None:
        for p in self.procs:  # all at once: a rank waiting for a stopped peer need not time out
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            _stop_child(p)
        if self.comm_name is not None:
            from tidal.parallel import unlink_segment

            unlink_segment(self.comm_name)
            self.comm_name = None
        sweep_stale_segments()  # what a rank killed with SIGKILL could not unlink


def _stop_child(proc: multiprocessing.Process) -> None:
    t0 = time.monotonic()
    if proc.is_alive():
        proc.terminate()
        proc.join(CHILD_STOP_TIMEOUT_S)
    if proc.is_alive():
        logger.warning("scheduler (pid %d) ignored SIGTERM; killing it", proc.pid)
        proc.kill()
        proc.join(CHILD_STOP_TIMEOUT_S)
    else:
        proc.join(0)
    logger.info("scheduler process stopped (exit code %s) in %.2fs", proc.exitcode, time.monotonic() - t0)


async def _main(args: ServerArgs, target: Callable, control: _Control, tmpdir: str, proc: list) -> int:
    to_addr, from_addr = f"ipc://{tmpdir}/to_scheduler", f"ipc://{tmpdir}/from_scheduler"
    sctx, actx = zmq.Context(), zmq.asyncio.Context()
    push = sctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    pull = actx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    tm: Optional[TokenizerManager] = None
    try:
        push.bind(to_addr)
        pull.bind(from_addr)
        proc.append(SchedulerProcs(target, args, to_addr, from_addr))
        tok_task = _load_tokenizer_in_thread(args)
        ready = await _wait_ready(pull, proc[0], control, tok_task)
        if isinstance(ready, str):
            print(f"tidal: scheduler failed to start: {ready}", file=sys.stderr, flush=True)
            logger.error("scheduler failed to start: %s", ready)
            return 0 if control.signum is not None else 1
        metrics = Metrics(args.model_name)
        tm = TokenizerManager(args, tokenizer=tok_task.result(), metrics=metrics)
        tm.start(push, pull, ready)
        return await _serve(args, ServerContext(args, tm, metrics), proc[0], control)
    finally:
        if tm is not None:
            await tm.stop()
        push.close(linger=0)
        pull.close(linger=0)
        sctx.term()
        actx.term()


def _load_tokenizer_in_thread(args: ServerArgs) -> asyncio.Future:
    """Load the tokenizer while the scheduler loads the model. A daemon thread, not an
    executor: a failed start must not wait at exit for a load nobody needs."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def done(result: Any, exc: Optional[BaseException]) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

    def work() -> None:
        try:
            result: tuple = (load_server_tokenizer(args), None)
            _one_torch_thread()
        except BaseException as e:  # noqa: BLE001 - reported through the future
            result = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(done, *result)

    threading.Thread(target=work, name="tidal-tokenizer-load", daemon=True).start()
    return fut


def _one_torch_thread() -> None:
    """The API process runs no heavy tensor work: if transformers brought torch in, any op it
    ever runs stays on one thread instead of starting an OpenMP pool next to the scheduler's."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


async def _wait_ready(pull: Any, proc: SchedulerProcs, control: _Control,
                      tok_task: asyncio.Future) -> Union[SchedulerReady, str]:
    """SchedulerReady (with the tokenizer loaded), or why not."""
    deadline = time.monotonic() + START_TIMEOUT_S
    ready: Optional[SchedulerReady] = None
    while ready is None or not tok_task.done():
        if control.signum is not None:
            return f"interrupted by signal {control.signum}"
        if tok_task.done() and tok_task.exception() is not None:
            return f"cannot load the tokenizer: {tok_task.exception()!r}"
        if ready is None and not proc.is_alive():
            return f"a scheduler process exited with code {proc.exitcode} before it was ready"
        if time.monotonic() > deadline:
            return f"no SchedulerReady within {START_TIMEOUT_S:.0f}s"
        if ready is None and await pull.poll(100):
            msg = decode_to_api(await pull.recv())
            if isinstance(msg, SchedulerError):
                return msg.message
            if isinstance(msg, SchedulerReady):
                ready = msg
                logger.info("scheduler ready: %s", msg)
        elif ready is not None:
            await asyncio.sleep(0.05)
    if tok_task.exception() is not None:
        return f"cannot load the tokenizer: {tok_task.exception()!r}"
    return ready


async def _serve(args: ServerArgs, ctx: ServerContext, proc: SchedulerProcs, control: _Control) -> int:
    config = uvicorn.Config(
        create_app(ctx), host=args.host, port=args.port, log_level=args.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off", access_log=False,
        http=h11_with_read_timeout(args.http_read_timeout_secs))
    server = _Server(config)
    control.server = server
    if control.signum is not None:
        return 0
    tasks = [asyncio.ensure_future(_watch_scheduler(proc, ctx.tm, server, control)),
             asyncio.ensure_future(_announce(server, args))]
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return 1 if control.scheduler_died else 0


async def _announce(server: _Server, args: ServerArgs) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("tidal server ready at http://%s:%d", args.host, args.port)


async def _watch_scheduler(proc: SchedulerProcs, tm: TokenizerManager, server: _Server,
                           control: _Control) -> None:
    """If the scheduler dies (or reports an error) while serving: fail requests, exit non-zero."""
    while not server.should_exit:
        if not proc.is_alive():
            tm.mark_dead(f"a scheduler process exited with code {proc.exitcode}")
            sweep_stale_segments()
        if tm.dead_reason is not None:
            control.scheduler_died = control.signum is None
            logger.error("scheduler is gone (%s); shutting down", tm.dead_reason)
            await asyncio.sleep(DEATH_EXIT_DELAY_S)
            server.should_exit = True
            return
        await asyncio.sleep(0.1)
