"""`tidal profile --url URL`: measure one server and write its profile JSON."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import Any, Iterator

from tidal.config import keys_from_env


def int_list(text: str) -> list[int]:
    """"32,128,512" -> [32, 128, 512]; every entry a positive integer."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(kind: type, name: str):
    """An argparse type: text -> kind, which must be > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {name.split()[-1]}, got {text!r}")
        return value
    return parse


_positive_float = _positive(float, "a number")
_positive_int = _positive(int, "an integer")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--url", required=True,
      help="the tidal server to measure, e.g. http://127.0.0.1:30000 (required, no default). It must run on this "
      "machine: the CPU flags recorded are this host's (/proc/cpuinfo). It must be idle and in null mode, "
      "unless --measure-switch is given")
    a("--output", default="profile.json", help="where to write the profile JSON")
    a("--prefill-tokens", type=int_list, default=[32, 128, 512, 2048], metavar="N,N,...",
      help="prompt lengths (tokens) whose prefill time is measured, one request at a time "
      "(default: 32,128,512,2048)")
    a("--prefill-batches", type=int_list, default=[2, 4, 8], metavar="K,K,...",
      help="numbers of prompts prefilled together in one step whose time is measured, each with every "
      "--prefill-tokens length that one prefill step takes whole (chunked-prefill size); 1 measures none "
      "(default: 2,4,8)")
    a("--decode-batches", type=int_list, default=[], metavar="B,B,...",
      help="numbers of concurrent requests whose decode step time is measured (default: 1,4,8 and doubling up "
      "to the server's max running requests, e.g. 1,4,8,16,32,64: past the largest batch measured the cost "
      "model only extrapolates, along the line through the two largest at the same context per request)")
    a("--decode-contexts", type=int_list, default=[64, 512], metavar="L,L,...",
      help="prompt length (tokens) of each request in the decode runs; the profile records the batch's "
      "total KV length (default: 64,512)")
    a("--decode-tokens", type=_positive_int, default=32,
      help="tokens generated per request in each decode run")
    a("--repeats", type=_positive_int, default=3,
      help="timed runs per prefill length and per decode cell, after a warm-up; the median is kept")
    a("--timeout-s", type=_positive_float, default=120.0,
      help="timeout of every HTTP call to the server, seconds (a streamed decode request: between two reads)")
    a("--measure-switch", action="store_true",
      help="also time role switches (every direction between null, prefill and decode) and the idle drain. "
      "This CHANGES THE SERVER'S MODE while it runs (the original mode is restored at the end, also on "
      "failure); needs a server started with --enable-dynamic-disaggregation (default: off)")
    a("--decode-url", default=None,
      help="a decode-mode server paired with --url's for the KV-transfer measurement (same transfer backend and "
      "page size); needs --measure-switch, since --url's server is switched to prefill mode for it. Without it "
      "kv_transfer is [] (default: none)")
    a("--api-key", default=None, help="Bearer key for the server's API routes (default: $TIDAL_API_KEY, else none)")
    a("--admin-api-key", default=None,
      help="Bearer key for the switch route (default: $TIDAL_ADMIN_API_KEY, else --api-key)")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def grid_problem(ns: argparse.Namespace) -> str:
    """Why the grid asked for cannot make a cost model ("" when it can): the model draws lines between measured
    points, and with one prompt length (or one decode batch size) every prompt (or batch) would cost the same."""
    if len(set(ns.prefill_tokens)) < 2:
        return "--prefill-tokens needs two lengths or more: the cost model draws lines between them"
    if ns.decode_batches and len(set(ns.decode_batches)) < 2:
        return "--decode-batches needs two sizes or more: the cost model draws lines between them"
    return ""


def output_problem(path: str) -> str:
    """Why the profile could not be written at `path` ("" when it could): checked before minutes of measuring."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"no directory {folder}"
    if os.path.isdir(path):
        return "it is a directory"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return "not writable"
    return ""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (kill, timeout, a service manager) stops the run as Ctrl-C does, so that the server's original
    mode is put back before the process exits."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_profile_cli(ns: argparse.Namespace) -> int:
    from tidal.profile.measure import Options, ProfileError, run_profile
    from tidal.profile.schema import ProfileFormatError, save_profile

    keys_from_env(ns)
    problem = grid_problem(ns)
    if problem:
        _say(f"tidal profile: error: {problem}")
        return 2
    opts = Options(url=ns.url, prefill_tokens=ns.prefill_tokens, prefill_batches=ns.prefill_batches,
                   decode_batches=ns.decode_batches,
                   decode_contexts=ns.decode_contexts, decode_tokens=ns.decode_tokens, repeats=ns.repeats,
                   timeout_s=ns.timeout_s, measure_switch=ns.measure_switch, decode_url=ns.decode_url,
                   api_key=ns.api_key,
                   admin_api_key=ns.admin_api_key, log=_say)
    unwritable = output_problem(ns.output)
    if unwritable:
        _say(f"tidal profile: error: cannot write {ns.output}: {unwritable}")
        return 1
    try:
        with sigterm_interrupts():
            profile = run_profile(opts)
        save_profile(profile, ns.output)
    except (ProfileError, ProfileFormatError) as e:
        _say(f"tidal profile: error: {e}")
        return 1
    except OSError as e:
        _say(f"tidal profile: error: cannot write {ns.output}: {e.strerror or e}")
        return 1
    except KeyboardInterrupt:
        _say("tidal profile: interrupted")
        return 130
    except Exception as e:  # a bug or a server answering nonsense: still one line, not a traceback
        _say(f"tidal profile: error: unexpected {type(e).__name__}: {e}")
        return 1
    for note in opts.notes:
        _say(f"note: {note}")
    _say(f"wrote {ns.output}")
    return 0
