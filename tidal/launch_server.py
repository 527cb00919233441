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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal.launch_server", description="Start a tidal server.",
                                     formatter_class=DefaultsHelpFormatter)
    add_server_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = server_args_from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    configure_logging(args.log_level)
    from tidal.server.launch import (
        launch_server,  # imports fastapi/uvicorn: after argument errors
    )

    return launch_server(args)


if __name__ == "__main__":
    from tidal.leftovers import exit_now

    exit_now(main())  # launch_server stopped the schedulers and removed what it created
