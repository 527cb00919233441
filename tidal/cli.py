"""The `tidal` command: serve, router, cluster, bench, profile, sim."""

from __future__ import annotations

import argparse
import re
import sys

# argparse takes "-1:3:2" for an option (only plain negative numbers are values): such a value is joined to its flag
NEGATIVE_LIST = re.compile(r"-\d[\d.]*[:,][-\d.:,]*")


def join_negative_lists(argv: list[str]) -> list[str]:
    """`--phase-layouts -1:3:2` as `--phase-layouts=-1:3:2`, so that the flag's own check says what is wrong."""
    out: list[str] = []
    for token in argv:
        if NEGATIVE_LIST.fullmatch(token) and out and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] += "=" + token
        else:
            out.append(token)
    return out


def build_parser() -> argparse.ArgumentParser:
    from tidal.cli_help import DefaultsHelpFormatter
    from tidal.config import add_server_args

    parser = argparse.ArgumentParser(prog="tidal", description="tidal LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = {"formatter_class": DefaultsHelpFormatter}
    serve = sub.add_parser("serve", help="start an SGLang/OpenAI-compatible server", **fmt)
    add_server_args(serve)
    bench = sub.add_parser("bench", help="benchmark any SGLang/OpenAI-compatible server", **fmt)
    from tidal.bench import add_bench_args

    add_bench_args(bench)
    router = sub.add_parser("router", help="prefill/decode-aware router in front of tidal or SGLang workers", **fmt)
    from tidal.router.cli import add_router_args

    add_router_args(router)
    cluster = sub.add_parser("cluster", help="prefill + decode servers and a router on this machine", **fmt)
    from tidal.cluster import add_cluster_args

    add_cluster_args(cluster)
    profile = sub.add_parser("profile", help="measure one server's prefill, decode and switch costs into a JSON "
                             "profile for the planner and the simulator", **fmt)
    from tidal.profile.cli import add_profile_args

    add_profile_args(profile)
    sim = sub.add_parser("sim", help="simulate a cluster in virtual time (router, planner, admission as live)", **fmt)
    from tidal.sim.cli import add_sim_args

    add_sim_args(sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(join_negative_lists(sys.argv[1:] if argv is None else argv))
    if args.command == "serve":
        from tidal.launch_server import serve

        serve(args, build_parser())
    if args.command == "router":
        from tidal.router.cli import run_router

        return run_router(args)
    if args.command == "cluster":
        from tidal.cluster import run_cluster
        from tidal.leftovers import exit_now

        exit_now(run_cluster(args))  # the cluster's processes and shared memory are gone
    if args.command == "profile":
        from tidal.profile.cli import run_profile_cli

        return run_profile_cli(args)
    if args.command == "sim":
        from tidal.sim.cli import run_sim

        return run_sim(args)
    if args.command == "bench":
        from tidal.bench import run_bench

        run_bench(args)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
