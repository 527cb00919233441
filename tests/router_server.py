"""A real tidal router (uvicorn in a background thread) for tests against mock workers."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import httpx
import uvicorn

from mock_worker import free_port
from tidal.router.app import create_router_app
from tidal.router.config import RouterConfig
from tidal.router.workers import Worker


class RouterServer:
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("health_check_interval_s", 60.0)
        kwargs.setdefault("health_check_timeout_s", 1.0)
        kwargs.setdefault("retry_initial_backoff_s", 0.01)
        self.cfg = RouterConfig(host="127.0.0.1", port=free_port(), **kwargs)
        self.url = f"http://127.0.0.1:{self.cfg.port}"
        self.app = create_router_app(self.cfg)
        self.state = self.app.state.router
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.cfg.port, log_level="error",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "RouterServer":
        self.thread.start()
        wait_for(lambda: self.server.started, 10, "router start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=10)

    def worker(self, url: str) -> Worker:
        return self.state.registry.get(url)


def wait_for(cond: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
