"""A clean first run: every flag documented with its default, unique OpenAPI ids, docs inside the repo."""

from __future__ import annotations

import argparse
import collections
import os
import re
import warnings

import pytest

from tidal.cli import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["serve", "router", "cluster", "bench", "profile", "sim"])
def test_every_flag_has_help_with_its_default(command: str) -> None:
    p = _subparsers()[command]
    formatter = p._get_formatter()
    missing, no_default = [], []
    for action in p._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        name = action.option_strings[-1]
        if not action.help:
            missing.append(name)
            continue
        text = formatter._expand_help(action)
        if "default" not in text.lower():
            no_default.append(name)
    assert not missing, f"tidal {command}: flags without help: {missing}"
    assert not no_default, f"tidal {command}: help does not show the default: {no_default}"


def _duplicate_operation_ids(app) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = app.openapi()
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    return [k for k, n in collections.Counter(ids).items() if n > 1]


def test_openapi_operation_ids_are_unique() -> None:
    from tidal.config import ServerArgs
    from tidal.router.app import create_router_app
    from tidal.router.config import RouterConfig
    from tidal.server.app import ServerContext, create_app

    server = create_app(ServerContext(ServerArgs(model_path="/models/m.gguf"), tm=None, metrics=None))
    assert _duplicate_operation_ids(server) == []
    assert _duplicate_operation_ids(create_router_app(RouterConfig())) == []


def test_docs_point_only_inside_the_repo() -> None:
    outside = re.compile(r"\.\./shared|shared/DESIGN|shared/data|shared/perf|shared/seeds")
    offenders = []
    for root in ("README.md", "docs"):
        path = os.path.join(REPO, root)
        files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)
                                                      if f.endswith(".md")]  # docs also hold PNGs
        for f in files:
            for i, line in enumerate(open(f, encoding="utf-8"), 1):
                if outside.search(line):
                    offenders.append(f"{os.path.relpath(f, REPO)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
