"""Authentication of every control route and secrets kept in: server, router, bootstrap server.

Each state-changing route is sent without a key, with a wrong key and with path variants
(`//x`, trailing slash, upper case, `%2F`): it must answer 401 or 404 and its handler must
not run. In-process ASGI clients cover the matrix; real processes check the same on the
wire, the log file and /server_info.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from typing import Any, Optional

import httpx
import msgspec
import pytest
from starlette.testclient import TestClient

from fake_scheduler import cached_tokenizer_dir, default_gguf_path
from mock_worker import MockWorker
from servers import Server, free_port
from tidal.config import ServerArgs, mask_secrets
from tidal.messages import FlushCacheResp, ModeStatusResp, SwitchModeResp
from tidal.router.app import create_router_app
from tidal.router.config import RouterConfig
from tidal.server.app import ServerContext, create_app
from tidal.server.metrics import Metrics
from tidal.server.protocol import ApiError
from tidal.transfer import bootstrap as bootstrap_mod
from tidal.transfer.bootstrap import BootstrapServer

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "tests", "fake_scheduler.py")
API, ADMIN, BOOT, WORKER_ADMIN = "sk-api-3f9a", "sk-admin-71c2", "sk-boot-55e0", "sk-wadmin-a1b2"
ROUTER_ADMIN = "sk-radmin-d4c3"
MODEL_PATH = "/opt/secret-models/dir-xyz/tiny.gguf"


def bearer(key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def variants(path: str) -> list[str]:
    """Spellings of `path` that a careless guard would let through to the handler."""
    inner = path.find("/", 1)
    pct = path[:inner] + "%2F" + path[inner + 1:] if inner > 0 else "/%2F" + path[1:]
    return [path, "/" + path, path + "/", path.upper(), pct, path.replace("_", "%5F", 1)]


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code in (401, 404), (r.request.url, r.status_code, r.text)


def assert_secret_free(text: str, *secrets: str) -> None:
    for s in secrets:
        assert s not in text, f"{s!r} leaked"


def test_mask_secrets_is_generic():
    info = {"api_key": "a", "Admin_API_Key": "b", "hf_token": "c", "client_secret": "d", "db_password": "e",
            "unset_key": None, "max_total_tokens": 7, "nested": [{"worker_admin_api_key": "f"}]}
    masked = mask_secrets(info)
    assert masked == {"api_key": "<set>", "Admin_API_Key": "<set>", "hf_token": "<set>", "client_secret": "<set>",
                      "db_password": "<set>", "unset_key": None, "max_total_tokens": 7,
                      "nested": [{"worker_admin_api_key": "<set>"}]}


# ---------------------------------------------------------------- server, in process


class _Status(msgspec.Struct):
    status_code: int = 200
    message: str = "ok"
    current_mode: str = "null"


class RecordingTM:
    """The TokenizerManager surface the admin and info routes use; records every call that changes state."""

    alive, ready, dead_reason = True, None, None

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def flush_cache(self):
        self.calls.append("flush_cache")
        return FlushCacheResp(call_id=0, success=True)

    def abort_request(self, rid, abort_all) -> int:
        self.calls.append("abort_request")
        return 0

    async def switch_mode(self, mode, drain, timeout_s, flush_cache, handover=False, migrate_to=(), migrate_timeout_s=30.0):
        self.calls.append("switch_mode")
        return SwitchModeResp(call_id=0, status_code=200, status="ok", message="", current_mode=mode, epoch=1)

    async def prepare_mode(self, mode):
        self.calls.append("prepare_mode")
        return _Status()

    async def mode_status(self):
        return ModeStatusResp(call_id=0, current_mode="null", transition_state="idle", target_mode=None, epoch=0,
                              last_error=None)

    async def get_stats(self, timeout=None):
        raise ApiError("no scheduler in this test", 503)


SERVER_ADMIN_ROUTES = [  # (method, path, body)
    ("POST", "/flush_cache", None),
    ("GET", "/flush_cache", None),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/admin/switch_disaggregation_mode", {"mode": "decode"}),
    ("POST", "/admin/prepare_mode", {"mode": "decode"}),
    ("POST", "/pd_role_switch", {"new_role": "decode"}),
]


def server_client(api_key: Optional[str], admin_key: Optional[str]) -> tuple[TestClient, RecordingTM]:
    args = ServerArgs(model_path=MODEL_PATH, api_key=api_key, admin_api_key=admin_key,
                      disaggregation_bootstrap_key=BOOT)
    tm = RecordingTM()
    app = create_app(ServerContext(args, tm, Metrics(args.model_name)))  # type: ignore[arg-type]
    return TestClient(app, base_url="http://t", follow_redirects=False), tm


def send(client: Any, method: str, path: str, body: Any, headers: dict) -> httpx.Response:
    return client.request(method, "http://t" + path, json=body, headers=headers)


@pytest.mark.parametrize("keys", [(API, ADMIN), (None, ADMIN), (API, None)], ids=["both", "admin-only", "api-only"])
def test_server_admin_routes_refuse_missing_wrong_and_variant(keys):
    api_key, admin_key = keys
    client, tm = server_client(api_key, admin_key)
    wrong = [{}, bearer("wrong"), {"Authorization": "Basic " + (admin_key or api_key)},
             {"Authorization": f"Bearer {admin_key or api_key}x"}]
    if api_key and admin_key:
        wrong.append(bearer(api_key))  # the API key does not open admin routes when an admin key is set
    for method, path, body in SERVER_ADMIN_ROUTES:
        for p in variants(path):
            for headers in wrong:
                assert_refused(send(client, method, p, body, headers))
    assert tm.calls == []


@pytest.mark.parametrize("keys", [(API, ADMIN), (None, ADMIN), (API, None)], ids=["both", "admin-only", "api-only"])
def test_server_right_key_opens_admin_routes(keys):
    api_key, admin_key = keys
    client, tm = server_client(api_key, admin_key)
    for method, path, body in SERVER_ADMIN_ROUTES:
        r = send(client, method, path, body, bearer(admin_key or api_key))
        assert r.status_code == 200, (path, r.text)
    assert tm.calls == ["flush_cache", "flush_cache", "abort_request", "switch_mode", "prepare_mode", "switch_mode"]


def test_server_both_keys_api_routes():
    client, _ = server_client(API, ADMIN)
    for headers, status in (({}, 401), (bearer("wrong"), 401), (bearer(API), 200), (bearer(ADMIN), 200)):
        for p in ("/v1/models", "/server_info", "/model_info"):
            assert client.get("http://t" + p, headers=headers).status_code == status, (p, headers)
    assert client.get("http://t/health").status_code == 200


def test_server_no_keys_stays_open():
    client, tm = server_client(None, None)
    assert send(client, "POST", "/flush_cache", None, {}).status_code == 200 and tm.calls == ["flush_cache"]


INFO_ROUTES = ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models")


@pytest.mark.parametrize("keys", [(None, None), (None, ADMIN)], ids=["no-keys", "admin-only"])
def test_server_info_hides_secrets_and_paths_from_anonymous_callers(keys):
    client, _ = server_client(*keys)
    for p in INFO_ROUTES:
        r = client.get("http://t" + p)
        assert r.status_code == 200
        assert_secret_free(r.text, ADMIN, BOOT, "/opt/secret-models", "dir-xyz")
        assert "tiny.gguf" in r.text  # the model's name instead
    info = client.get("http://t/server_info").json()
    assert info["model_path"] == "tiny.gguf" and info["disaggregation_bootstrap_key"] == "<set>"
    assert info["admin_api_key"] == ("<set>" if keys[1] else None)


def test_server_info_shows_paths_but_no_keys_to_authenticated_callers():
    client, _ = server_client(API, ADMIN)
    for key in (API, ADMIN):
        for p in INFO_ROUTES:
            r = client.get("http://t" + p, headers=bearer(key))
            assert r.status_code == 200 and MODEL_PATH in r.text
            assert_secret_free(r.text, API, ADMIN, BOOT)


# ---------------------------------------------------------------- router, in process


@pytest.fixture
def mock_worker():
    w = MockWorker("null").start()
    yield w
    w.stop()


def router_client(worker: MockWorker, **keys: Any) -> TestClient:
    cfg = RouterConfig(workers=[worker.url], health_check_interval_s=60, **keys)
    return TestClient(create_router_app(cfg), base_url="http://t", follow_redirects=False)


def router_admin_routes(worker: MockWorker) -> list[tuple[str, str, Any]]:
    extra = free_port()
    return [
        ("POST", f"/add_worker?url=http://127.0.0.1:{extra}&role=decode", None),
        ("POST", f"/remove_worker?url={worker.url}", None),
        ("POST", "/flush_cache", None),
        ("GET", "/flush_cache", None),
        ("POST", "/admin/set_worker_role", {"url": worker.url, "mode": "decode"}),
    ]


def router_variants(path_and_query: str) -> list[str]:
    path, sep, query = path_and_query.partition("?")
    return [v + sep + query for v in variants(path)]


def assert_router_untouched(client: TestClient, worker: MockWorker) -> None:
    workers = client.get("http://t/workers", headers=bearer(API)).json()["workers"]
    assert [(w["url"], w["role"]) for w in workers] == [(worker.url, "null")]
    assert worker.flushes == 0


ROUTER_KEYS = {"api_key": API, "admin_api_key": ADMIN, "worker_admin_api_key": WORKER_ADMIN}


def test_router_state_changing_routes_need_the_router_admin_key(mock_worker):
    with router_client(mock_worker, **ROUTER_KEYS) as client:
        for method, path, body in router_admin_routes(mock_worker):
            for p in router_variants(path):
                for headers in ({}, bearer("wrong"), bearer(API), bearer(WORKER_ADMIN)):
                    assert_refused(send(client, method, p, body, headers))
        assert_router_untouched(client, mock_worker)
        assert send(client, "POST", "/flush_cache", None, bearer(ADMIN)).status_code == 200
        assert mock_worker.flushes == 1
        extra = f"http://127.0.0.1:{free_port()}"
        r = send(client, "POST", f"/add_worker?url={extra}&role=decode", None, bearer(ADMIN))
        assert r.status_code == 200, r.text
        assert send(client, "POST", f"/remove_worker?url={extra}", None, bearer(ADMIN)).status_code == 200


@pytest.mark.parametrize("keys", [{"api_key": API}, {"worker_admin_api_key": WORKER_ADMIN}],
                         ids=["api", "worker-admin"])
def test_router_with_worker_keys_but_no_admin_key_refuses_admin_routes(mock_worker, keys):
    with router_client(mock_worker, **keys) as client:
        for method, path, body in router_admin_routes(mock_worker):
            for headers in ({}, bearer(API), bearer(WORKER_ADMIN)):
                r = send(client, method, path, body, headers)
                assert r.status_code == 401 and "--admin-api-key" in r.text
        assert_router_untouched(client, mock_worker)


def test_router_without_keys_stays_open(mock_worker):
    with router_client(mock_worker) as client:
        assert send(client, "POST", "/flush_cache", None, {}).status_code == 200 and mock_worker.flushes == 1


def test_router_api_key_guards_generation(mock_worker):
    with router_client(mock_worker, **ROUTER_KEYS) as client:
        body = {"text": "hi"}
        for p in ("/generate", "/v1/completions", "/v1/chat/completions", "//generate", "/GENERATE"):
            for headers in ({}, bearer("wrong")):
                assert_refused(send(client, "POST", p, body, headers))
        assert mock_worker.requests == []
        for key in (API, ADMIN):
            assert send(client, "POST", "/generate", body, bearer(key)).status_code == 200
        assert len(mock_worker.requests) == 2
        assert send(client, "GET", "/server_info", None, {}).status_code == 401


# ---------------------------------------------------------------- real server + router processes


def fake_server_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, FAKE, "--model-path", default_gguf_path(), "--tokenizer-path", cached_tokenizer_dir(),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *extra]


def test_real_server_and_router_keep_keys_in(tmp_path):
    cached_tokenizer_dir()
    port = free_port()
    server = Server(cmd=fake_server_cmd(port, "--admin-api-key", ADMIN, "--disaggregation-bootstrap-key", BOOT),
                    port=port)
    router = None
    try:
        rport = free_port()
        router = Server(cmd=[sys.executable, "-m", "tidal.router", "--host", "127.0.0.1", "--port", str(rport),
                             "--worker", server.url, "--admin-api-key", ROUTER_ADMIN, "--worker-admin-api-key", ADMIN,
                             "--log-level", "info"], port=rport)
        model_dir = os.path.dirname(default_gguf_path())
        for url in (server.url, router.url):  # anonymous callers: no key, no path
            for p in INFO_ROUTES:
                r = httpx.get(url + p, timeout=10)
                assert r.status_code == 200, (url, p, r.text)
                assert_secret_free(r.text, ROUTER_ADMIN, ADMIN, BOOT, model_dir)
        workers = httpx.get(router.url + "/server_info", timeout=10).json()["workers"]
        info = workers[0]["server_info"]
        assert info["disaggregation_mode"] == "null" and info["tp_size"] == 1 and info["epoch"] == 0
        assert info["disaggregation_bootstrap_port"] == 8998 and info["admin_api_key"] == "<set>"
        assert model_dir in httpx.get(server.url + "/model_info", headers=bearer(ADMIN)).text

        for p in variants("/flush_cache") + variants("/admin/switch_disaggregation_mode"):
            for headers in ({}, bearer("wrong"), bearer(ROUTER_ADMIN)):
                assert_refused(httpx.post(server.url + p, json={"mode": "decode"}, headers=headers))
            for headers in ({}, bearer("wrong"), bearer(ADMIN)):  # the workers' key is not the router's
                assert_refused(httpx.post(router.url + p, json={"mode": "decode"}, headers=headers))
        for p in router_variants(f"/add_worker?url=http://127.0.0.1:{free_port()}"):
            for headers in ({}, bearer("wrong"), bearer(ADMIN)):
                assert_refused(httpx.post(router.url + p, headers=headers))
        assert len(httpx.get(router.url + "/workers").json()["workers"]) == 1
        # the router's own key, then the worker admin key on the worker
        r = httpx.post(router.url + "/flush_cache", headers=bearer(ROUTER_ADMIN), timeout=10)
        assert r.status_code == 200 and r.json()["workers"][0]["status"] == 200
        assert httpx.post(router.url + "/generate", json={"text": "hi"}, timeout=30).status_code == 200
    finally:
        if router is not None:
            router.stop()
        server.stop()
    for log in (server.log.name, router.log.name):
        text = open(log).read()
        assert "INFO" in text
        assert_secret_free(text, ROUTER_ADMIN, ADMIN, BOOT)


# ---------------------------------------------------------------- bootstrap server

REG = {"role": "Prefill", "rank_ip": "127.0.0.1", "rank_port": 40000, "engine_rank": 0, "tp_size": 1,
       "page_size": 16, "kv_dtype": "bfloat16", "prefill_id": "p-real"}
RANK0 = "/route?engine_rank=0&target_dp_group=0&target_pp_rank=0"


def call(port: int, method: str, path: str, body: Any = None, headers: Optional[dict] = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    return resp.status, (json.loads(raw) if raw.startswith(b"{") else {})


@pytest.fixture
def keyed_bootstrap():
    s = BootstrapServer("127.0.0.1", 0, key=BOOT)
    s.start()
    assert call(s.port, "PUT", "/route", REG, bearer(BOOT))[0] == 200
    yield s
    s.stop()


def test_bootstrap_refuses_unkeyed_registrations(keyed_bootstrap):
    port = keyed_bootstrap.port
    hijack = {**REG, "rank_ip": "10.6.6.6", "rank_port": 6666, "prefill_id": "evil"}
    for p in variants("/route"):
        for headers in ({}, bearer("wrong"), {"Authorization": BOOT}):
            status, _ = call(port, "PUT", p, hijack, headers)
            assert status in (401, 404, 405), (p, status)
            query = "?engine_rank=0&target_dp_group=0&target_pp_rank=0&prefill_id=p-real"
            status, _ = call(port, "DELETE", p + query, headers=headers)
            assert status in (401, 404, 405), (p, status)
    status, rank = call(port, "GET", RANK0)
    assert status == 200 and (rank["rank_ip"], rank["rank_port"], rank["prefill_id"]) == ("127.0.0.1", 40000, "p-real")
    assert call(port, "DELETE", RANK0 + "&prefill_id=p-real", headers=bearer(BOOT))[0] == 200
    assert call(port, "GET", RANK0)[0] == 503


def test_prefill_manager_registers_with_its_key(keyed_bootstrap):
    import torch

    from tidal.kvcache.kv_pool import MHATokenToKVPool
    from tidal.transfer import KVArgs, MetadataBuffers, create_kv_manager

    def manager(key: Optional[str]):
        pool = MHATokenToKVPool(64, 4, torch.float16, 1, 1, 8)
        args = KVArgs(0, pool, MetadataBuffers(2), 4, "float16", bootstrap_key=key)
        return create_kv_manager("tcp", args, "prefill", keyed_bootstrap.port)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rejected"):
        manager("wrong")
    assert time.monotonic() - t0 < 4  # refused at once, not retried until the timeout
    good = manager(BOOT)
    try:
        assert good.id in keyed_bootstrap.prefill_ids()
    finally:
        good.shutdown()
    assert good.id not in keyed_bootstrap.prefill_ids()  # deregistered with the key


def test_bootstrap_decode_peers_are_bounded(monkeypatch, keyed_bootstrap):
    monkeypatch.setattr(bootstrap_mod, "MAX_DECODE_PEERS", 5)
    monkeypatch.setattr(bootstrap_mod, "PEER_TTL_S", 0.5)
    port = keyed_bootstrap.port
    for i in range(20):
        assert call(port, "POST", "/heartbeat", {"decode_id": f"d{i}"})[0] == 200
    assert len(keyed_bootstrap.decode_peers()) == 5
    time.sleep(0.7)
    call(port, "POST", "/heartbeat", {"decode_id": "fresh"})
    assert list(keyed_bootstrap.decode_peers()) == ["fresh"]


def test_args_repr_masks_keys():
    from tidal.router.config import RouterConfig

    text = repr(ServerArgs(api_key=API, admin_api_key=ADMIN, disaggregation_bootstrap_key=BOOT))
    text += repr(RouterConfig(api_key=API, admin_api_key=ROUTER_ADMIN, worker_admin_api_key=WORKER_ADMIN))
    assert_secret_free(text, API, ADMIN, BOOT, ROUTER_ADMIN, WORKER_ADMIN)
    assert "api_key='<set>'" in text


def test_keys_come_from_the_environment_when_not_on_the_command_line(monkeypatch) -> None:
    """Keys on a command line are world-readable in /proc/PID/cmdline; TIDAL_* variables are not."""
    import argparse

    from tidal.config import add_server_args, server_args_from_namespace
    from tidal.router.cli import add_router_args, router_config_from_namespace

    monkeypatch.setenv("TIDAL_API_KEY", "env-api")
    monkeypatch.setenv("TIDAL_ADMIN_API_KEY", "env-admin")
    monkeypatch.setenv("TIDAL_WORKER_ADMIN_API_KEY", "env-worker")
    sp = argparse.ArgumentParser()
    add_server_args(sp)
    args = server_args_from_namespace(sp.parse_args(["--model-path", "/m.gguf", "--admin-api-key", "cli-admin"]))
    assert (args.api_key, args.admin_api_key) == ("env-api", "cli-admin")  # the command line wins
    rp = argparse.ArgumentParser()
    add_router_args(rp)
    cfg = router_config_from_namespace(rp.parse_args([]))
    assert (cfg.api_key, cfg.admin_api_key, cfg.worker_admin_api_key) == ("env-api", "env-admin", "env-worker")


def test_internal_errors_do_not_echo_exception_text(caplog) -> None:
    """A 500 names an error id and the exception type; the text (paths, internals) stays in the log."""
    from starlette.testclient import TestClient

    from tidal.config import ServerArgs
    from tidal.router.app import create_router_app
    from tidal.router.config import RouterConfig
    from tidal.server.app import ServerContext, create_app

    secret = "/home/ops/models/private.gguf token=abc123"
    apps = [create_app(ServerContext(ServerArgs(model_path="/m.gguf"), tm=None, metrics=None)),
            create_router_app(RouterConfig())]
    for app in apps:
        async def boom() -> None:
            raise RuntimeError(secret)

        app.add_api_route("/boom", boom, methods=["GET"])
        with TestClient(app, raise_server_exceptions=False) as client:
            r = client.get("/boom")
        assert r.status_code == 500 and "RuntimeError" in r.text and secret not in r.text
        error_id = r.json()["error"]["message"].split()[2]
        assert any(error_id in rec.getMessage() and secret in rec.exc_text for rec in caplog.records
                   if rec.exc_text), "the log keeps the details under the id"
