"""The roles see the scheduler loop only through tidal/roles/loop.py (issue 66: the scheduler/roles circle).

Static checks (ast): no module under tidal/roles imports tidal.scheduler.scheduler, and what the roles
touch of the loop is exactly what RoleLoop (ControllerLoop for roles/controller.py) lists. Runtime check:
a constructed Scheduler has every member of both protocols.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Optional

import pytest

from fakes import FakeModelRunner
from tidal.config import ServerArgs
from tidal.roles.loop import ControllerLoop, RankGroup, RoleLoop, RoleRunner
from tidal.scheduler.scheduler import Scheduler

ROLES = Path(__file__).resolve().parent.parent / "tidal" / "roles"
FORBIDDEN = "tidal.scheduler.scheduler"
LOOP_ROOTS = ("s", "sched")  # the names the role modules give the loop (and self.s)


def role_modules() -> list[Path]:
    return sorted(p for p in ROLES.glob("*.py"))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(tree: ast.Module) -> set[str]:
    """Every module an import statement names, anywhere (TYPE_CHECKING blocks and functions too)."""
    package = "tidal.roles"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from .. import scheduler
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}  # from tidal.scheduler import scheduler
    return found


def protocol_members(proto: type) -> dict[str, str]:
    """name -> "attr" | "property" | "method", over the protocol and the protocols it extends."""
    members: dict[str, str] = {}
    for klass in reversed(proto.__mro__):
        if not getattr(klass, "_is_protocol", False) or klass.__module__ == "typing":
            continue
        for name in inspect.get_annotations(klass):
            members[name] = "attr"
        for name, value in klass.__dict__.items():
            if name.startswith("_"):
                continue
            if isinstance(value, property):
                members[name] = "property"
            elif callable(value):
                members[name] = "method"
    return members


def chain(node: ast.AST) -> Optional[list[str]]:
    """`a.b.c` -> ["a", "b", "c"] when it starts at a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def loop_path(parts: list[str]) -> Optional[tuple[str, list[str]]]:
    """("loop", the path below the loop) for `self.s.mem.release` -> ("loop", ["mem", "release"]);
    ("tp", [member]) for the TP group the controller keeps (`self.tp`) and ranks.py takes (`tp`); else None."""
    if parts[:2] == ["self", "s"]:
        return "loop", parts[2:]
    if parts[0] in LOOP_ROOTS:
        return "loop", parts[1:]
    if parts[:2] == ["self", "tp"]:
        return "tp", parts[2:]
    if parts[0] == "tp":
        return "tp", parts[1:]
    return None


def is_loop(node: ast.AST) -> bool:
    """The loop itself: `self.s`, `s` or `sched`."""
    parts = chain(node)
    return parts is not None and (parts == ["self", "s"] or parts in [[r] for r in LOOP_ROOTS])


def loop_uses(tree: ast.Module) -> tuple[set[str], set[str], set[str], list[str]]:
    """(loop members, TP group members, runner members) the module touches; and dynamic accesses."""
    members, tp, runner, dynamic = set(), set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = chain(node)
            found = loop_path(parts) if parts else None
            if not found or not found[1]:
                continue
            kind, path = found
            if kind == "tp":
                tp.add(path[0])
                continue
            members.add(path[0])
            if path[0] == "tp" and len(path) > 1:
                tp.add(path[1])
            if path[0] == "runner" and len(path) > 1:
                runner.add(path[1])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args \
                and node.func.id in ("getattr", "setattr", "hasattr", "vars") and is_loop(node.args[0]):
            dynamic.append(f"line {node.lineno}: {node.func.id}({'.'.join(chain(node.args[0]))}, ...)")
    return members, tp, runner, dynamic


CONTROL_MODULES = ("controller.py", "migration.py")  # see the loop as ControllerLoop


@pytest.mark.parametrize("path", role_modules(), ids=lambda p: p.name)
def test_no_role_module_imports_the_scheduler(path):
    tree = parse(path)
    assert FORBIDDEN not in imported_modules(tree), f"{path.name} imports {FORBIDDEN}: use tidal.roles.loop.RoleLoop"
    named = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "Scheduler"
             or isinstance(n, ast.Constant) and n.value == "Scheduler"]  # a string annotation too
    assert not named, f"{path.name} names Scheduler (lines {named}): type the loop as RoleLoop (tidal/roles/loop.py)"


def test_roles_touch_exactly_what_the_protocols_list():
    role_members, controller_members = set(protocol_members(RoleLoop)), set(protocol_members(ControllerLoop))
    used_by_roles, used_by_controller, used_tp, used_runner = set(), set(), set(), set()
    for path in role_modules():
        if path.name == "loop.py":
            continue
        members, tp, runner, dynamic = loop_uses(parse(path))
        assert not dynamic, f"{path.name} reaches the loop dynamically: {dynamic}"
        controls = path.name in CONTROL_MODULES
        allowed = controller_members if controls else role_members
        assert members <= allowed, (f"{path.name} uses {sorted(members - allowed)} of the loop, not in "
                                    f"{'ControllerLoop' if controls else 'RoleLoop'}")
        (used_by_controller if controls else used_by_roles).update(members)
        used_tp |= tp
        used_runner |= runner
    # exact: a member no role uses any more goes from the protocol too
    assert role_members == used_by_roles, f"unused RoleLoop members: {sorted(role_members - used_by_roles)}"
    assert controller_members == used_by_roles | used_by_controller, \
        f"unused ControllerLoop members: {sorted(controller_members - used_by_roles - used_by_controller)}"
    assert used_tp <= set(protocol_members(RankGroup)), f"TP group members beyond RankGroup: {used_tp}"
    assert used_runner <= set(protocol_members(RoleRunner)), f"runner members beyond RoleRunner: {used_runner}"


def assigned_attrs(cls: type) -> set[str]:
    """The `self.X` a class assigns in its methods (instance attributes no instance is needed for)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            found.add(node.attr)
    return found


def check_members(obj, proto: type) -> None:
    for name, kind in protocol_members(proto).items():
        assert hasattr(obj, name), f"{type(obj).__name__} has no {name} ({proto.__name__})"
        if kind == "method":
            assert callable(getattr(obj, name)), f"{type(obj).__name__}.{name} is not callable ({proto.__name__})"
        if kind == "property":
            assert not callable(getattr(obj, name)), f"{type(obj).__name__}.{name} should be a value"


@pytest.mark.parametrize("kw", [{}, {"enable_dynamic_disaggregation": True},
                                {"disaggregation_mode": "decode", "disaggregation_transfer_backend": "fake"}],
                         ids=["null", "switchable", "decode"])
def test_scheduler_provides_the_protocols(kw):
    sched = Scheduler(ServerArgs(model_path="fake", **kw), FakeModelRunner(max_total_tokens=256), tokenizer=None)
    try:
        check_members(sched, ControllerLoop)  # RoleLoop's members with it
        check_members(sched.tp, RankGroup)
        check_members(sched.runner, RoleRunner)
        assert sched.tree_cache is sched.mem.tree_cache
        assert sched.chunked_req is sched.planner.chunked_req
        for name, kind in protocol_members(ControllerLoop).items():
            if kind == "property":
                assert isinstance(getattr(Scheduler, name), property), f"Scheduler.{name} is not a property"
    finally:
        sched.shutdown()


def test_real_tp_group_and_runner_provide_the_protocols():
    from tidal.model.runner import ModelRunner
    from tidal.parallel.comm import ShmComm, SingleRank

    check_members(SingleRank(), RankGroup)
    for cls, proto in ((ShmComm, RankGroup), (ModelRunner, RoleRunner)):
        have = assigned_attrs(cls) | {n for n in dir(cls) if not n.startswith("_")}
        missing = set(protocol_members(proto)) - have
        assert not missing, f"{cls.__name__} lacks {sorted(missing)} ({proto.__name__})"
