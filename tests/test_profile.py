"""`tidal profile` and its cost model: interpolation on hand-made profiles (values worked out by
hand in the comments), the file format, the steady-state window of the decode measurement, and one
run against a real server."""

from __future__ import annotations

import concurrent.futures
import copy
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from servers import Server, free_port
from tidal.cli import main
from tidal.cpus import cpu_flags
from tidal.profile.cost import CostModel, host_mismatch
from tidal.profile.measure import steady_intervals
from tidal.profile.schema import ProfileFormatError, load_profile, profile_from_dict, save_profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_profile(**overrides) -> dict:
    d = {
        "version": 1,
        "measured_at": "2026-11-24T00:00:00+00:00",
        "server": {"url": "http://127.0.0.1:1", "model": "m", "quantization": "gguf", "dtype": "float32",
                   "torch_threads": 2, "cpu_flags": ["avx2", "fma"], "page_size": 1, "max_total_tokens": 9000,
                   "max_running_requests": 16, "prefill_step_tokens": 2048,
                   "transfer_backend": "tcp"},
        "prefill": [{"tokens": 100, "seconds": 1.0}, {"tokens": 200, "seconds": 1.5}, {"tokens": 400, "seconds": 3.5}],
        "prefill_batch": [],
        "decode": [{"batch": 1, "context_tokens": 100, "step_seconds": 0.010},
                   {"batch": 1, "context_tokens": 300, "step_seconds": 0.030},
                   {"batch": 3, "context_tokens": 300, "step_seconds": 0.020},
                   {"batch": 3, "context_tokens": 900, "step_seconds": 0.050}],
        "kv_transfer": [],
        "switch": [],
        "drain": None,
    }
    d.update(overrides)
    return d


# ------------------------------------------------------------------ cost model


def test_prefill_interpolates_between_points_and_extrapolates_the_end_segments():
    cm = CostModel.from_dict(make_profile())
    assert cm.prefill_seconds(100) == pytest.approx(1.0)
    assert cm.prefill_seconds(150) == pytest.approx(1.25)  # halfway 1.0 -> 1.5
    assert cm.prefill_seconds(300) == pytest.approx(2.5)  # halfway 1.5 -> 3.5
    assert cm.prefill_seconds(500) == pytest.approx(4.5)  # last slope 2.0/200 per token: 3.5 + 100 * 0.01
    assert cm.prefill_seconds(50) == pytest.approx(0.75)  # first slope 0.5/100: 1.0 - 50 * 0.005
    assert cm.prefill_seconds(0) == 0.0


def test_extrapolation_never_goes_below_zero():
    cm = CostModel.from_dict(make_profile(
        prefill=[{"tokens": 100, "seconds": 0.1}, {"tokens": 200, "seconds": 1.1}],
        decode=[{"batch": 1, "context_tokens": 100, "step_seconds": 0.01},
                {"batch": 2, "context_tokens": 100, "step_seconds": 0.05}]))
    assert cm.prefill_seconds(50) == 0.0  # 0.1 - 50 * 0.01 = -0.4
    assert cm.decode_step_seconds(1, 100) == pytest.approx(0.01)
    assert cm.decode_step_seconds(0, 100) == 0.0
    # batch 1 row and batch 2 row are constant in context; linear in batch: 0.01 + 0.04 * (b - 1)
    assert cm.decode_step_seconds(3, 5000) == pytest.approx(0.09)


def test_a_step_past_the_largest_batch_grows_with_the_batch_not_faster():
    # the 2026-11-25 profile's rows: a line through batches 8 and 16 at 64 x 528 tokens gave 1.24 s, the
    # server measured 0.35 s
    cm = CostModel.from_dict(make_profile(decode=[
        {"batch": 8, "context_tokens": 640, "step_seconds": 0.0514},
        {"batch": 8, "context_tokens": 4224, "step_seconds": 0.0593},
        {"batch": 16, "context_tokens": 1280, "step_seconds": 0.0786},
        {"batch": 16, "context_tokens": 8448, "step_seconds": 0.1239}]))
    at_528 = [cm.decode_step_seconds(b, b * 528) for b in (8, 16)]
    assert cm.decode_step_seconds(64, 64 * 528) == pytest.approx(at_528[1] + 6 * (at_528[1] - at_528[0]))
    assert cm.decode_step_seconds(64, 64 * 528) < 0.6


def test_repeated_points_are_averaged():
    cm = CostModel.from_dict(make_profile(prefill=[{"tokens": 100, "seconds": 1.0}, {"tokens": 100, "seconds": 2.0},
                                                   {"tokens": 300, "seconds": 3.5}]))
    assert cm.prefill_seconds(100) == pytest.approx(1.5)
    assert cm.prefill_seconds(200) == pytest.approx(2.5)


def test_a_prefill_step_of_several_prompts_shares_what_its_batch_points_measured():
    # alone 1.0 s (100 tokens), 1.5 (200), 3.5 (400); 4 x 100 together in 3.1 s share (4 x 1.0 - 3.1) / 3 = 0.3,
    # 2 x 200 in 2.6 s share 0.4
    cm = CostModel.from_dict(make_profile(prefill_batch=[{"batch": 4, "tokens": 100, "seconds": 3.1},
                                                         {"batch": 2, "tokens": 200, "seconds": 2.6}]))
    assert cm.prefill_shared_seconds(100) == pytest.approx(0.3)
    assert cm.prefill_shared_seconds(150) == pytest.approx(0.35)
    assert cm.prefill_step_seconds([100] * 4) == pytest.approx(3.1)
    assert cm.prefill_step_seconds([200, 200]) == pytest.approx(2.6)
    assert cm.prefill_step_seconds([100, 200]) == pytest.approx(1.0 + 1.5 - 0.35)  # shared at the mean, 150
    assert cm.prefill_step_seconds([400, 400, 400]) == pytest.approx(3 * 3.5 - 2 * 0.6)  # shared extrapolated
    assert cm.prefill_step_seconds([0, 150]) == pytest.approx(cm.prefill_seconds(150))  # alone
    assert cm.prefill_step_seconds([]) == 0.0


def test_without_batch_points_a_prefill_step_costs_one_prompt_of_its_total_length():
    cm = CostModel.from_dict(make_profile())
    assert cm.prefill_step_seconds([100, 200]) == pytest.approx(cm.prefill_seconds(300)) == pytest.approx(2.5)
    assert cm.prefill_shared_seconds(100) == 0.0 and not cm.has_prefill_batches


def test_a_prefill_batch_never_costs_less_than_its_slowest_prompt_alone():
    # 2 x 100 in 0.5 s would share 1.5 s, more than one prompt's 1.0: capped there
    cm = CostModel.from_dict(make_profile(prefill_batch=[{"batch": 2, "tokens": 100, "seconds": 0.5}]))
    assert cm.prefill_step_seconds([100, 100]) == pytest.approx(1.0)
    assert cm.prefill_step_seconds([100, 104]) == pytest.approx(cm.prefill_seconds(104))


@pytest.mark.parametrize("max_running, kv_tokens, batches", [
    (64, 470657, [1, 4, 8, 16, 32, 64]),  # the default server on a 2-core CPU box
    (48, 470657, [1, 4, 8, 16, 32, 48]),
    (64, 10000, [1, 4, 8, 16, 18]),  # 18 runs of 544 tokens fill the KV pool
    (1, 470657, [1]),
])
def test_the_default_decode_grid_reaches_the_servers_largest_batch(max_running, kv_tokens, batches):
    from tidal.profile.measure import ServerFacts, default_decode_batches
    from tidal.profile.schema import ServerInfo
    facts = ServerFacts(info=ServerInfo(max_total_tokens=kv_tokens, max_running_requests=max_running,
                                        prefill_step_tokens=2048), mode="null",
                        switchable=False, vocab_size=49152, context_length=8192, max_input_tokens=8000,
                        max_running_requests=max_running)
    assert default_decode_batches(facts, longest=512 + 32) == batches


def test_decode_is_bilinear_on_the_measured_grid():
    cm = CostModel.from_dict(make_profile())
    assert cm.decode_step_seconds(1, 200) == pytest.approx(0.020)  # on row 1, halfway
    assert cm.decode_step_seconds(3, 600) == pytest.approx(0.035)  # on row 3, halfway 0.020 -> 0.050
    # batch 2, context 300: row 1 gives 0.030, row 3 gives 0.020; halfway between the rows
    assert cm.decode_step_seconds(2, 300) == pytest.approx(0.025)
    # batch 2, context 600: row 1 extrapolated 0.010 + 500 * 0.0001 = 0.060, row 3 0.035 -> 0.0475
    assert cm.decode_step_seconds(2, 600) == pytest.approx(0.0475)
    # batch 5 (past the last row), context 900 (180 per request): the rows at 180 and 540 tokens give 0.018 and
    # 0.032; +0.007 per batch -> 0.046 (at the same total context the rows gave 0.090 and 0.050: 0.010, a
    # step cheaper than batch 3's)
    assert cm.decode_step_seconds(5, 900) == pytest.approx(0.046)


def test_decode_reproduces_a_linear_cost_exactly_inside_and_outside_the_grid():
    def cost(b: int, c: int) -> float:
        return 0.01 + 0.002 * b + 0.00001 * c

    grid = [(1, 100), (1, 500), (4, 400), (4, 2000), (8, 800), (8, 4000)]
    cm = CostModel.from_dict(make_profile(decode=[{"batch": b, "context_tokens": c, "step_seconds": cost(b, c)}
                                                  for b, c in grid]))
    for b, c in [(2, 1000), (6, 3000), (16, 10000), (1, 50)]:
        assert cm.decode_step_seconds(b, c) == pytest.approx(cost(b, c))


def test_remembered_steps_are_the_ones_computed_and_the_memory_stays_bounded(monkeypatch):
    """The cost model remembers what it computed (the planner asks the same steps for every layout): a second
    model asked in another order gives the same values, and the memory is emptied once it holds MEMO_SIZE."""
    import tidal.profile.cost as cost

    monkeypatch.setattr(cost, "MEMO_SIZE", 8)
    asked = [(b, c) for b in (1, 2, 3, 5) for c in (50, 300, 900)]
    first, second = CostModel.from_dict(make_profile()), CostModel.from_dict(make_profile())
    got = {(b, c): first.decode_step_seconds(b, c) for b, c in asked}
    assert {(b, c): second.decode_step_seconds(b, c) for b, c in reversed(asked)} == got
    assert got[2, 300] == pytest.approx(0.025) and first.decode_step_seconds(2, 300) == got[2, 300]
    assert [first.prefill_seconds(n) for n in (150, 150, 300)] == [1.25, 1.25, 2.5]
    assert 0 < len(first._decode_memo) <= 8


def test_switch_transfer_and_capacity():
    cm = CostModel.from_dict(make_profile(
        switch=[{"src": "null", "dst": "prefill", "seconds": 0.004},
                {"src": "prefill", "dst": "decode", "seconds": 0.002},
                {"src": "null", "dst": "prefill", "seconds": 0.006}],
        kv_transfer=[{"tokens": 100, "bytes": 1000, "seconds": 0.01}, {"tokens": 300, "bytes": 3000, "seconds": 0.03}],
        drain={"seconds_idle": 0.003}))
    assert cm.switch_seconds("null", "prefill") == pytest.approx(0.005)  # two measurements averaged
    assert cm.switch_seconds("prefill", "decode") == pytest.approx(0.002)
    assert cm.switch_seconds("decode", "null") == pytest.approx(0.005)  # not measured: the slowest measured
    assert cm.switch_seconds("decode", "decode") == 0.0
    with pytest.raises(ValueError, match="unknown mode"):
        cm.switch_seconds("null", "colocated")
    assert cm.kv_transfer_seconds(200) == pytest.approx(0.02)
    assert cm.kv_transfer_seconds(600) == pytest.approx(0.06)
    assert cm.drain_seconds_idle == pytest.approx(0.003)
    assert cm.max_total_tokens == 9000
    assert cm.prefill_step_tokens == 2048
    empty = CostModel.from_dict(make_profile())
    assert empty.kv_transfer_seconds(200) == 0.0 and empty.switch_seconds("null", "decode") == 0.0


# ------------------------------------------------------------------ the file


def test_save_then_load_gives_the_same_profile(tmp_path):
    original = profile_from_dict(make_profile(switch=[{"src": "null", "dst": "decode", "seconds": 0.002}],
                                              drain={"seconds_idle": 0.001}))
    path = str(tmp_path / "p.json")
    save_profile(original, path)
    assert load_profile(path) == original
    assert json.load(open(path)) == make_profile(switch=[{"src": "null", "dst": "decode", "seconds": 0.002}],
                                                 drain={"seconds_idle": 0.001})
    assert CostModel.from_file(path).prefill_seconds(150) == pytest.approx(1.25)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("decode"), "missing required field `decode`"),
    (lambda d: d["prefill"][1].update(seconds=-1.0), r"\$.prefill\[1\].seconds"),
    (lambda d: d["server"].update(gpu="x"), "unknown field `gpu`"),
    (lambda d: d["server"].pop("max_total_tokens"), "missing required field `max_total_tokens`"),
    (lambda d: d["switch"].append({"src": "null", "dst": "colocated", "seconds": 0.1}), r"\$.switch\[0\].dst"),
    (lambda d: d.update(version=2), "unsupported profile version 2"),
    (lambda d: d.update(prefill_batch=[{"batch": 1, "tokens": 8, "seconds": 0.1}]), r"\$.prefill_batch\[0\].batch"),
    (lambda d: d.update(prefill=[]), "no prefill points"),
])
def test_a_malformed_profile_is_refused_with_what_is_wrong(tmp_path, change, message):
    d = copy.deepcopy(make_profile())
    change(d)
    with pytest.raises(ProfileFormatError, match=message):
        CostModel.from_dict(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileFormatError, match=f"{path}: .*{message}"):
        load_profile(str(path))


def test_a_hand_written_profile_needs_only_capacity_and_the_curves(tmp_path):
    minimal = {"version": 1, "server": {"max_total_tokens": 4096},
               "prefill": [{"tokens": 10, "seconds": 0.01}], "decode": [{"batch": 1, "context_tokens": 0,
                                                                        "step_seconds": 0.02}]}
    cm = CostModel.from_dict(minimal)
    assert cm.max_total_tokens == 4096 and cm.prefill_seconds(99) == pytest.approx(0.01)
    assert cm.profile.kv_transfer == [] and cm.profile.switch == [] and cm.profile.drain is None
    assert cm.max_running_requests == 0  # not recorded: the planner caps a batch by the KV capacity alone
    assert cm.prefill_step_tokens == 0  # not recorded: the planner assumes the server's default budget
    save_profile(cm.profile, str(tmp_path / "p.json"))
    written = json.load(open(tmp_path / "p.json"))
    assert set(written) == {"version", "measured_at", "server", "prefill", "prefill_batch", "decode", "kv_transfer",
                            "switch", "drain"}
    assert set(written["server"]) == {"url", "model", "quantization", "dtype", "torch_threads", "cpu_flags",
                                      "page_size", "max_total_tokens", "max_running_requests", "prefill_step_tokens",
                                      "transfer_backend"}


def test_a_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ProfileFormatError, match="not a tidal profile"):
        load_profile(str(path))
    with pytest.raises(ProfileFormatError, match="cannot read profile"):
        load_profile(str(tmp_path / "missing.json"))


def test_the_shipped_profile_loads():
    path = os.path.join(REPO, "tidal", "profile", "data", "smollm2_cpu_2core.json")
    cm = CostModel.from_file(path)
    assert "avx2" in cm.profile.server.cpu_flags
    assert cm.prefill_seconds(512) > 0 and cm.decode_step_seconds(8, 4096) > 0


# ------------------------------------------------------------------ measurement pieces


def test_the_decode_window_starts_when_all_run_and_ends_when_one_finishes():
    # two requests with 4-token prompts; (time, tokens so far). Request b's first token at t=1.0,
    # request a finishes at t=1.3: only intervals inside [1.0, 1.3] count.
    a = [(0.5, 1), (0.9, 2), (1.0, 3), (1.1, 4), (1.3, 6)]  # the last event carries two tokens
    b = [(1.0, 1), (1.1, 2), (1.2, 3), (1.3, 4), (1.5, 5)]
    intervals, kv = steady_intervals([a, b], prompt_tokens=4)
    assert sorted(round(x, 6) for x in intervals) == [0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    assert sorted(kv) == sorted([4 + 3, 4 + 4, 4 + 5, 4 + 1, 4 + 2, 4 + 3])  # token n: prompt + n - 1


def test_a_profile_from_a_cpu_with_other_simd_flags_is_flagged():
    profile = CostModel.from_dict(make_profile()).profile  # avx2 fma
    assert host_mismatch(profile, ["avx2", "fma", "sse2", "aes"]) is None  # other flags do not matter
    warning = host_mismatch(profile, ["avx2", "avx512f", "avx512_bf16", "fma"])
    assert "it lacked avx512_bf16 avx512f" in warning and "tidal profile" in warning
    assert "it had fma" in host_mismatch(profile, ["avx2"])
    assert host_mismatch(profile, []) is None  # this host's flags unknown


def test_cpu_flags_come_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nflags\t\t: fma avx2 sse2 avx2\n\nprocessor\t: 1\nflags\t\t: fma\n")
    assert cpu_flags(str(path)) == ["avx2", "fma", "sse2"]
    assert cpu_flags(str(tmp_path / "none")) == []


def test_an_unreachable_server_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    rc = main(["profile", "--url", f"http://127.0.0.1:{free_port()}", "--output", str(tmp_path / "p.json"),
               "--timeout-s", "5"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "tidal profile: error: cannot connect to" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_a_server_that_is_not_tidal_is_a_clear_error(tmp_path, capsys):
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        rc = main(["profile", "--url", f"http://127.0.0.1:{other.server_port}", "--output", str(tmp_path / "p.json")])
    finally:
        other.shutdown()
        other.server_close()
    err = capsys.readouterr().err
    assert rc == 1
    assert "/server_info: HTTP 404" in err and "Traceback" not in err


# ------------------------------------------------------------------ a real server


def profile_cmd(url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli", "profile", "--url", url, *extra],
                          capture_output=True, text=True, timeout=240)


def terminated_mid_run(url: str, *args: str) -> subprocess.CompletedProcess:
    """`tidal profile` sent SIGTERM once it has switched the server out of its mode."""
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "profile", "--url", url, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        original = httpx.get(url + "/server_info", timeout=30).json()["disaggregation_mode"]
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if httpx.get(url + "/server_info", timeout=30).json()["disaggregation_mode"] != original:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.02)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(300)
def test_profile_a_real_server_with_a_decode_peer_and_restore_its_mode(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both load the model at once
        prefill = pool.submit(Server, "--enable-dynamic-disaggregation", "--disaggregation-mode", "prefill",
                              "--disaggregation-bootstrap-port", str(free_port()), "--torch-threads", "1")
        decode = pool.submit(Server, "--disaggregation-mode", "decode", "--torch-threads", "1")
        servers = [f.result() for f in (prefill, decode) if f.exception() is None]
        errors = [repr(f.exception()) for f in (prefill, decode) if f.exception() is not None]
    out = tmp_path / "profile.json"
    try:
        assert not errors, f"a server did not start: {errors}"
        s, d = servers
        grid = ["--output", str(out), "--prefill-tokens", "16,256", "--prefill-batches", "2,16",
                "--decode-batches", "1,2", "--decode-contexts", "16", "--decode-tokens", "8", "--repeats", "1",
                "--timeout-s", "60"]
        refused = [profile_cmd(s.url, *grid),  # a prefill-mode server without --measure-switch
                   profile_cmd(s.url, *grid, "--measure-switch", "--decode-batches", "1,100"),
                   profile_cmd(d.url, *grid, "--measure-switch")]  # not switchable
        run = profile_cmd(s.url, *grid, "--decode-url", d.url, "--measure-switch")
        mode = httpx.get(s.url + "/server_info", timeout=30).json()["disaggregation_mode"]
        stopped = terminated_mid_run(s.url, *grid, "--measure-switch", "--repeats", "5")
        mode_after_sigterm = httpx.get(s.url + "/server_info", timeout=30).json()["disaggregation_mode"]
    finally:
        for server in servers:
            server.stop()
    assert [r.returncode for r in refused] == [1, 1, 1]
    assert "the server is in prefill mode" in refused[0].stderr
    assert "--decode-batches 100 exceeds the server's max running requests" in refused[1].stderr
    assert "needs a server started with --enable-dynamic-disaggregation" in refused[2].stderr
    assert all("Traceback" not in r.stderr for r in refused)
    assert run.returncode == 0, run.stderr
    assert mode == "prefill"  # switched to null to measure, then back
    # SIGTERM (kill, timeout) in the middle: the run stops as on Ctrl-C, and the server is back in prefill mode
    assert stopped.returncode == 130 and "tidal profile: interrupted" in stopped.stderr, stopped.stderr
    assert mode_after_sigterm == "prefill"
    cm = CostModel.from_file(str(out))
    p = cm.profile
    assert [x.tokens for x in p.prefill] == [16, 256] and all(x.seconds > 0 for x in p.prefill)
    assert p.prefill[1].seconds > p.prefill[0].seconds  # 16x the tokens; loose on a noisy box
    # 16 x 256 tokens exceed one prefill step (the chunked-prefill size, 2048): not measured
    assert [(x.batch, x.tokens) for x in p.prefill_batch] == [(2, 16), (2, 256), (16, 16)]
    assert all(x.seconds > 0 for x in p.prefill_batch)
    assert [x.batch for x in p.decode] == [1, 2]
    for x in p.decode:  # KV lengths 16 + n - 1 for the n-th token, n in 2..8
        assert x.batch * 17 <= x.context_tokens <= x.batch * 23
        assert x.step_seconds > 0
    directions = {(x.src, x.dst) for x in p.switch}
    assert directions == {(a, b) for a in ("null", "prefill", "decode") for b in ("null", "prefill", "decode")
                          if a != b}
    assert all(x.seconds > 0 for x in p.switch) and p.drain is not None
    assert p.server.max_total_tokens == 8192 and p.server.transfer_backend == "tcp" and p.server.torch_threads == 1
    assert [x.tokens for x in p.kv_transfer] == [16, 256]
    assert p.kv_transfer[0].bytes > 0 and p.kv_transfer[1].bytes == 16 * p.kv_transfer[0].bytes  # page size 1
    assert all(x.seconds >= 0 for x in p.kv_transfer)


def test_an_output_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys):
    """No server is asked (none listens on the port): the output path is checked first."""
    url = f"http://127.0.0.1:{free_port()}"
    for output, says in ((tmp_path, "it is a directory"), (tmp_path / "no" / "p.json", "no directory")):
        assert main(["profile", "--url", url, "--output", str(output)]) == 1
        err = capsys.readouterr().err
        assert f"tidal profile: error: cannot write {output}: {says}" in err and "cannot connect" not in err
    assert main(["profile", "--url", url, "--output", str(tmp_path / "p.json"), "--decode-url", url]) == 1
    err = capsys.readouterr().err
    assert "--decode-url needs --measure-switch" in err and "cannot connect" not in err


def test_a_profile_of_one_length_or_one_batch_is_said_to_be_flat(tmp_path, capsys):
    """One prefill length, or one decode batch size: no line to draw, the cost model gives that time everywhere;
    `tidal sim` and the planner say so, and no extrapolation warning claims a line. `tidal profile` refuses to
    measure such a grid."""
    from tidal.cli import main
    from tidal.profile.cost import flat_curves, prefill_extrapolation

    one = {"version": 1, "server": {"max_total_tokens": 100000}, "prefill": [{"tokens": 32, "seconds": 0.083}],
           "decode": [{"batch": 1, "context_tokens": c, "step_seconds": 0.02} for c in (64, 512)]}
    cm = CostModel.from_dict(one)
    assert cm.prefill_seconds(8000) == cm.prefill_seconds(32) == pytest.approx(0.083)
    said = flat_curves(cm.profile)
    assert "prefill at one prompt length (32 tokens)" in said and "decode at one batch size (1)" in said
    assert prefill_extrapolation(cm.profile, 8000) is None
    assert flat_curves(CostModel.from_dict(make_profile()).profile) is None
    path = tmp_path / "one.json"
    path.write_text(json.dumps(one))
    main(["sim", "--profile", str(path), "--instances", "2", "--duration-s", "20", "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert "the profile measured prefill at one prompt length" in err and "extrapolates" not in err
    for grid, says in ((["--prefill-tokens", "32"], "--prefill-tokens needs two lengths or more"),
                       (["--decode-batches", "4,4"], "--decode-batches needs two sizes or more")):
        assert main(["profile", "--url", "http://127.0.0.1:9", "--output", str(tmp_path / "p.json"), *grid]) == 2
        assert says in capsys.readouterr().err
