"""Import hygiene of the product packages (``shared``, ``edge_agent``, ``cloud_verifier``).

1. No import cycle among product modules. Every import counts, wherever it is written: at module
   level, inside a function, under ``if TYPE_CHECKING:``, in a ``try`` — a cycle hidden in a
   function is still a cycle (it only moves the failure to run time).
2. The product never imports ``bench`` or ``tests`` (they are not in the wheel).
3. Importing every product module leaves ``os.environ`` unchanged (no import side effects on the
   process environment): checked in a fresh interpreter, against a baseline taken after running
   the product's third-party import statements alone (torch, for one, sets
   ``TORCHINDUCTOR_CACHE_DIR`` when ``torch._dynamo`` is imported: not the product's doing).
4. The layers of ``shared`` (:data:`LAYERS`): each imports only the layers below it and none of the
   third-party packages its layer forbids (maths and wire: no torch, no asyncio, no aiohttp; the
   maths, below the wire, no msgpack; nothing below the runtime imports torch); ``shared`` never
   imports the edge or the verifier, and they never import each other. Each end is layered too,
   bottom up: session rules (no I/O, no torch), the model or engine, the links and the runtime
   (edge), the daemon (the edge's front doors).
5. A module lives in the package of its only user: every ``shared`` module is used (directly or
   through other ``shared`` modules) by both ``edge_agent`` and ``cloud_verifier``.
6. A module's underscore names are its own: no product module imports another's (a helper that
   is shared gets a public name where it lives).
"""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("shared", "edge_agent", "cloud_verifier")
FORBIDDEN = ("bench", "testkit", "tests")


@dataclass(frozen=True)
class Import:
    """One import statement (or literal ``importlib.import_module``) in a product module."""

    target: str  # the absolute dotted name imported (or its ``from`` base + name)
    path: Path
    line: int

    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"


def product_modules(packages: tuple[str, ...] = PRODUCT) -> dict[str, Path]:
    """Dotted name → file, for every module of ``packages`` (the product's by default)."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: str, path: Path) -> Iterator[Import]:
    """Every import anywhere in the file (``ast.walk`` visits function bodies and ``if`` blocks).

    ``from a.b import c`` yields ``a.b.c`` (a submodule, if it is one, is resolved by the caller)
    and ``a.b``; ``import a.b.c`` yields ``a.b.c``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, path, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            yield Import(base, path, node.lineno)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(f"{base}.{alias.name}", path, node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if (
                fname in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
            ):
                yield Import(arg.value, path, node.lineno)


def third_party_imports() -> list[tuple[str, list[str]]]:
    """The product's absolute imports of other packages, as ``(module, from-names)``, sorted."""
    modules = product_modules()
    found: dict[str, set[str]] = {}
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name, set())
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = {a.name for a in node.names if a.name != "*"}
                found.setdefault(node.module, set()).update(names)
    return sorted(
        (name, sorted(names))
        for name, names in found.items()
        if name.split(".")[0] not in (*PRODUCT, "__future__")
    )


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest product module that ``name`` is or lies in (``a.b.func`` → ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], Import]]:
    """Edges between product modules, and one import statement that creates each edge."""
    modules = product_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    why: dict[tuple[str, str], Import] = {}
    for module, path in modules.items():
        for imp in imports_of(module, path):
            target = _owner(imp.target, modules)
            if target is None:
                continue
            graph[module].add(target)
            why.setdefault((module, target), imp)
    return graph, why


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
    return out


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the component's first module (a shortest one, by breadth-first search)."""
    start = component[0]
    members = set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [start]
                    while node != start:
                        path.append(node)
                        node = previous[node]
                    return [start, *reversed(path[1:]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in {component}")


def find_cycles() -> list[str]:
    """A readable line per cyclic component: one concrete cycle, with the importing lines."""
    graph, why = import_graph()
    found = []
    for component in strongly_connected(graph):
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        cycle = _cycle_in(component, graph)
        steps = [f"{a} -> {b} ({why[a, b].where()})" for a, b in itertools.pairwise(cycle)]
        found.append(f"{{{', '.join(component)}}}: " + "; ".join(steps))
    return found


#: The layers, bottom up: a module's layer is the first whose prefix it has.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("shared.enums", "shared.errors"),  # the error root and its codes, TextEnum
    # the sampling parameters and transform, rejection, compression (numpy): pure values
    "maths": ("shared.maths",),
    "wire": ("shared.wire",),  # the frames, their codec (msgpack), the mux
    "runtime": ("shared.runtime",),  # torch: devices, the paged KV, the batched forward, models
    "service": ("shared.service",),  # daemons: settings, metrics, HTTP guards, systemd
    # each end, bottom up: session rules (pure cores), then the model or the engine, then the
    # network (the edge's links), then the daemon that wires them to users
    "edge.session": ("edge_agent.session",),  # the session cores and their events: no I/O
    "edge.model": ("edge_agent.model",),  # the draft model and its worker
    "edge.link": ("edge_agent.link",),  # verifier links, drivers feeding the cores
    # settings, the service and its agent, the link monitor, the text: one stream of events up
    "edge.runtime": ("edge_agent.runtime",),
    "edge.daemon": ("edge_agent.daemon",),  # the front doors: the HTTP APIs, the REPL, the CLI
    # the model work the session core asks for and the engine answers: plain data
    "verifier.work": ("cloud_verifier.engine.work",),
    "verifier.session": ("cloud_verifier.session",),  # the session core: no I/O, no model
    "verifier.engine": ("cloud_verifier.engine",),  # the target, its KV, the scheduler
    "verifier.daemon": ("cloud_verifier.daemon",),  # settings, the aiohttp app, metrics, CLI
}

_BELOW_SERVICES = {"base", "wire", "maths", "runtime", "service"}

#: The product layers each layer may import (besides itself).
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "maths": {"base"},
    "wire": {"base", "maths"},
    "runtime": {"base", "wire", "maths"},
    "service": {"base", "wire"},
    "edge.session": _BELOW_SERVICES,
    "edge.model": {*_BELOW_SERVICES, "edge.session"},
    "edge.link": {*_BELOW_SERVICES, "edge.session", "edge.model"},
    "edge.runtime": {*_BELOW_SERVICES, "edge.session", "edge.model", "edge.link"},
    "edge.daemon": {*_BELOW_SERVICES, "edge.session", "edge.model", "edge.link", "edge.runtime"},
    "verifier.work": _BELOW_SERVICES,
    "verifier.session": {*_BELOW_SERVICES, "verifier.work"},
    "verifier.engine": {*_BELOW_SERVICES, "verifier.work", "verifier.session"},
    "verifier.daemon": {*_BELOW_SERVICES, "verifier.work", "verifier.session", "verifier.engine"},
}

_IO = {"asyncio", "aiohttp", "socket", "ssl", "threading"}
_TORCH = {"torch", "transformers"}

#: Third-party (and I/O) packages each layer must not import.
FORBIDDEN_PACKAGES: dict[str, set[str]] = {
    "base": {"numpy", "msgpack", *_TORCH, *_IO},
    "wire": {*_TORCH, *_IO},
    "maths": {"msgpack", *_TORCH, *_IO},
    "runtime": {"asyncio", "aiohttp", "socket", "ssl"},
    "service": _TORCH,
    # the session rules are synchronous state machines: no event loop, no sockets, no model
    "edge.session": {*_TORCH, *_IO},
    "verifier.work": {*_TORCH, *_IO},
    "verifier.session": {*_TORCH, *_IO},
}


def layer_of(module: str) -> str | None:
    for layer, prefixes in LAYERS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    return None


def layer_violations(modules: dict[str, Path]) -> list[str]:
    """One line per import that breaks :data:`MAY_IMPORT` or :data:`FORBIDDEN_PACKAGES`, and
    per product module in no layer."""
    bad = []
    for module, path in modules.items():
        layer = layer_of(module)
        if layer is None:
            if module.count(".") > 0 or module not in PRODUCT:
                bad.append(f"{module} is in no layer (tests/shared/test_imports.py: LAYERS)")
            continue
        for imp in imports_of(module, path):
            top = imp.target.split(".")[0]
            if top in PRODUCT:
                target = _owner(imp.target, modules) or imp.target
                other = layer_of(target)
                if other is not None and other != layer and other not in MAY_IMPORT[layer]:
                    bad.append(f"{imp.where()}: {module} ({layer}) imports {target} ({other})")
            elif top in FORBIDDEN_PACKAGES.get(layer, set()):
                bad.append(f"{imp.where()}: {module} ({layer}) imports {imp.target}")
    return sorted(set(bad))


def single_user_modules(modules: dict[str, Path]) -> list[str]:
    """``shared`` modules that ``edge_agent`` or ``cloud_verifier`` never reaches (directly or
    through other ``shared`` modules): they belong in the package of their user."""
    graph, _ = import_graph()
    reached: dict[str, set[str]] = {}
    for package in ("edge_agent", "cloud_verifier"):
        seen: set[str] = set()
        todo = [m for m in graph if m.split(".")[0] == package]
        while todo:
            for child in graph[todo.pop()]:
                if child.startswith("shared.") and child not in seen:
                    seen.add(child)
                    todo.append(child)
        reached[package] = seen
    out = []
    for module in sorted(modules):
        if not module.startswith("shared.") or module.endswith("__init__"):
            continue
        if modules[module].name == "__init__.py":
            continue
        users = [p for p in ("edge_agent", "cloud_verifier") if module in reached[p]]
        if len(users) < 2:
            out.append(f"{module}: used by {users or 'nobody'}")
    return out


# --------------------------------------------------------------------------- the checker's own


def test_cycle_finder_finds_cycles_and_only_cycles() -> None:
    graph = {
        "a": {"b"},
        "b": {"c", "d"},
        "c": {"a"},
        "d": {"e"},
        "e": set(),
        "f": {"f"},
        "g": {"h"},
        "h": set(),
    }
    components = strongly_connected(graph)
    assert sorted(components) == [["a", "b", "c"], ["d"], ["e"], ["f"], ["g"], ["h"]]
    assert _cycle_in(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
    assert _cycle_in(["f"], graph) == ["f", "f"]


def test_imports_are_found_everywhere(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text(
        "from __future__ import annotations\n"
        "import os.path\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from shared.wire.messages import Hello\n"
        "def f():\n"
        "    import edge_agent.runtime.agent\n"
        "    from . import sibling\n"
        "    from ..up import thing\n"
        "    importlib.import_module('bench.run')\n"
    )
    names = {i.target for i in imports_of("pkg.sub.mod", src)}
    assert {
        "os.path",
        "shared.wire.messages.Hello",
        "edge_agent.runtime.agent",
        "pkg.sub.sibling",
        "pkg.up.thing",
        "bench.run",
    } <= names


# --------------------------------------------------------------------------- the product


def test_no_import_cycles_among_product_modules() -> None:
    cycles = find_cycles()
    assert not cycles, "import cycles among product modules:\n" + "\n".join(cycles)


def private_imports(modules: dict[str, Path]) -> list[str]:
    """One line per ``from <product module> import _name``: a module's underscore names are its
    own; a helper another module needs gets a public name where it lives."""
    bad = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] not in PRODUCT:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                    bad.append(f"{where}:{node.lineno}: {node.module}.{alias.name}")
    return bad


def test_no_module_imports_another_modules_private_names(tmp_path: Path) -> None:
    seeded = tmp_path / "user.py"
    seeded.write_text(
        "from cloud_verifier.daemon.state import _send, public\nfrom os import _exit\n"
    )
    assert private_imports({"user": seeded}) == [f"{seeded}:1: cloud_verifier.daemon.state._send"]
    bad = private_imports(product_modules())
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_the_layer_checker_sees_a_violation(tmp_path: Path) -> None:
    (tmp_path / "wire").mkdir()
    bad = tmp_path / "wire" / "codec.py"
    bad.write_text("import torch\nfrom shared.runtime.models import load_model\n")
    found = layer_violations({"shared.wire.codec": bad, "shared.stray": bad})
    assert any("imports torch" in line for line in found)
    assert any("(runtime)" in line for line in found)
    assert any("shared.stray is in no layer" in line for line in found)


def test_the_layers_hold() -> None:
    bad = layer_violations(product_modules())
    assert not bad, "layer contracts broken:\n" + "\n".join(bad)


def test_shared_holds_only_what_both_ends_use() -> None:
    bad = single_user_modules(product_modules())
    assert not bad, "shared modules with one user (move them to it):\n" + "\n".join(bad)


def test_product_never_imports_bench_or_tests() -> None:
    bad = []
    for module, path in product_modules().items():
        for imp in imports_of(module, path):
            if imp.target.split(".")[0] in FORBIDDEN:
                bad.append(f"{imp.where()}: {module} imports {imp.target}")
    assert not bad, "\n".join(sorted(set(bad)))


_ENV_PROBE = r"""
import importlib, json, os, sys, traceback

modules, third_party = json.loads(sys.argv[1]), json.loads(sys.argv[2])
product = set(modules)
writes = []


def hook(event, args):
    if event not in ("os.putenv", "os.unsetenv"):
        return
    frame, where = sys._getframe(1), None
    while frame is not None:  # the innermost product module being executed (imported)
        name = frame.f_globals.get("__name__")
        if frame.f_code.co_name == "<module>" and name in product:
            where = f"{name}:{frame.f_lineno}"
            break
        frame = frame.f_back
    writes.append([event, os.fsdecode(args[0]), where])


# Baseline: what the dependencies' own imports do (``from X import Y`` also resolves lazy
# attributes, as transformers' are). Missing optional dependencies are skipped.
for name, names in third_party:
    try:
        module = importlib.import_module(name)
        if names:
            __import__(name, fromlist=names)  # as `from` does: submodules named in the list
        for attr in names:
            getattr(module, attr, None)
    except BaseException:
        pass
before = dict(os.environ)
sys.addaudithook(hook)
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
after = dict(os.environ)
changed = {
    k: [before.get(k), after.get(k)]
    for k in sorted(set(before) | set(after))
    if before.get(k) != after.get(k)
}
print(json.dumps({"changed": changed, "writes": writes, "failed": failed}))
"""


def test_importing_product_modules_leaves_environment_unchanged() -> None:
    modules = sorted(m for m in product_modules() if not m.endswith("__main__"))
    run = subprocess.run(
        [sys.executable, "-c", _ENV_PROBE, json.dumps(modules), json.dumps(third_party_imports())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    problems = [f"{name} failed to import:\n{tb}" for name, tb in report["failed"].items()]
    # A write counts even if it stores the value already there (the test's own environment may
    # hold it: conftest sets HF_HUB_OFFLINE), and a change counts even if no hook saw it.
    keys = sorted(set(report["changed"]) | {w[1] for w in report["writes"]})
    for key in keys:
        if key in report["changed"]:
            old, new = report["changed"][key]
            what = f"{old!r} -> {new!r}"
        else:
            what = "written, value unchanged"
        by = sorted({f"{w[0]} by {w[2]}" for w in report["writes"] if w[1] == key})
        problems.append(f"os.environ[{key!r}]: {what} ({'; '.join(by) or 'writer unknown'})")
    assert not problems, "importing the product changed the process:\n" + "\n".join(problems)
