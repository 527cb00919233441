"""`python -m tidal.launch_server --model-path ...`: start one tidal server."""

from __future__ import annotations

import argparse
import logging
from typing import Optional, Sequence

from tidal.cli_help import DefaultsHelpFormatter
from tidal.config import add_server_args, server_args_from_namespace


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )


def serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Run the server the parsed flags describe, then exit without the interpreter's teardown
    (launch_server already stopped the schedulers and removed what it created)."""
    try:
        args = server_args_from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    configure_logging(args.log_level)
    from tidal.leftovers import exit_now
    from tidal.server.launch import launch_server  # imports fastapi/uvicorn: after argument errors

    exit_now(launch_server(args))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="tidal.launch_server", description="Start a tidal server.",
                                     formatter_class=DefaultsHelpFormatter)
    add_server_args(parser)
    serve(parser.parse_args(argv), parser)


if __name__ == "__main__":
    main()
