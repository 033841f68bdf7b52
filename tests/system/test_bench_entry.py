"""``python -m bench``: the list of studies, a study run by its name, an unknown name refused; the
registry against the benchmark page; and the benchmark's layout: dependencies point down only
(tests → bench → testkit → the product; a study imports no other study; the publishing tools
import only the libraries and testkit's network tools and provenance; testkit never imports
bench), no import cycle anywhere."""

from __future__ import annotations

import inspect
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from bench import registry
from bench.registry import STUDIES, Study
from tests.shared.test_imports import (
    _cycle_in,
    _owner,
    imports_of,
    product_modules,
    strongly_connected,
)

REPO = Path(__file__).resolve().parents[2]
CALLS: list[list[str]] = []


def main(argv: list[str]) -> int:
    """A stand-in study (this module, registered by the dispatch test)."""
    CALLS.append(list(argv))
    return 7


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m bench ARGS`` from the repository root."""
    cmd = [sys.executable, "-m", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)


def test_python_m_bench_lists_every_study_with_its_time_and_file() -> None:
    proc = _bench()
    assert proc.returncode == 0, proc.stderr
    for s in STUDIES:
        assert f"  {s.name}  " in proc.stdout, s.name
        assert s.time in proc.stdout and s.writes in proc.stdout, s.name


def test_a_study_runs_by_its_name_with_its_args(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Study("echo", __name__, "its arguments", "0 s", "nothing", "nowhere")
    monkeypatch.setattr(registry, "STUDIES", (*STUDIES, fake))
    CALLS.clear()
    assert registry.run(["echo", "--out", "/tmp/x", "3"]) == 7
    assert CALLS == [["--out", "/tmp/x", "3"]]


def test_an_unknown_study_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert registry.run(["no-such-study"]) == 2
    err = capsys.readouterr().err
    assert "no study 'no-such-study'" in err
    assert all(f"  {s.name}  " in err for s in STUDIES)
    proc = _bench("no-such-study", "--smoke")
    assert proc.returncode == 2 and "no study" in proc.stderr


def test_a_study_takes_its_own_args() -> None:
    """The real dispatch: ``python -m bench grid --help`` is the grid's parser."""
    proc = _bench("grid", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m bench grid") and "--traces" in proc.stdout


def test_every_entry_is_a_main_of_argv_and_its_page_gives_its_command() -> None:
    names = [s.name for s in STUDIES]
    assert len(names) == len(set(names))
    for s in STUDIES:
        assert s.kind in ("study", "publishing"), s
        assert s.module.startswith("bench.studies." if s.kind == "study" else "bench.publish.")
        params = list(inspect.signature(s.main()).parameters)
        assert len(params) == 1, (s.name, params)
        assert f"python -m bench {s.name}" in (REPO / s.page).read_text(), (s.name, s.page)
    studies = {p.stem for p in (REPO / "bench" / "studies").glob("*.py")} - {"__init__"}
    assert studies == {s.module.rsplit(".", 1)[1] for s in STUDIES if s.kind == "study"}


def test_the_benchmark_page_lists_the_registry() -> None:
    page = (REPO / registry.BENCH).read_text()
    begin, end = f"<!-- {registry.DOCS_MARKER}:begin -->", f"<!-- {registry.DOCS_MARKER}:end -->"
    assert page[page.index(begin) + len(begin) : page.index(end)].strip() == registry.markdown(), (
        "run: .venv/bin/python -m bench --write-docs"
    )


# ------------------------------------------------------------------------------ the layout

PACKAGES = ("shared", "edge_agent", "cloud_verifier", "bench", "testkit", "tests")


def _edges() -> dict[str, dict[str, str]]:
    """module → {imported module: where}, over the repository's own packages."""
    modules = product_modules(PACKAGES)
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}
    for module, path in modules.items():
        for imp in imports_of(module, path):
            target = _owner(imp.target, modules)
            # a package's __init__ is not an edge of its own submodules' imports
            if target and target != module and not module.startswith(target + "."):
                graph[module].setdefault(target, imp.where())
    return graph


def _may_import(module: str, target: str) -> bool:
    """The benchmark's and the test kit's rules (the product's are tests/shared/test_imports)."""
    if module.startswith("testkit"):
        return not target.startswith(("bench", "tests"))  # the product and testkit, never bench
    if not target.startswith(("bench", "testkit", "tests")) or target == "bench":
        return True  # the product, and the bench package (its docstring)
    if module.startswith("tests"):
        return True
    lib, net = target.startswith("bench.lib"), target.startswith("bench.net")
    # testkit's tools below the benchmark: the network tools and provenance
    tools = target in ("testkit.net", "testkit.provenance") or target.startswith("testkit.net.")
    if module.startswith("bench.lib"):
        return lib or tools
    if module.startswith("bench.net"):
        return lib or net or tools
    if module.startswith("bench.publish"):
        return lib or tools or target.startswith("bench.publish")
    if module.startswith("bench.studies."):
        return lib or net or target.startswith("testkit")  # never another study
    if module in ("bench.registry", "bench.__main__"):
        return lib or target == "bench.registry"
    return False


def test_dependencies_point_down_only() -> None:
    bad = [
        f"{module} imports {target} ({where})"
        for module, targets in _edges().items()
        if module.startswith(("bench", "testkit"))
        for target, where in targets.items()
        if not _may_import(module, target)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_anywhere() -> None:
    edges = _edges()
    graph = {m: set(t) for m, t in edges.items()}
    found = []
    for component in strongly_connected(graph):
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        cycle = _cycle_in(component, graph)
        found.append("; ".join(f"{a} -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(cycle)))
    assert not found, "\n".join(found)


def test_the_layout_checker_sees_a_study_importing_a_study() -> None:
    assert not _may_import("bench.studies.prefix", "bench.studies.overload")
    assert not _may_import("bench.lib.sim", "bench.net.ar_server")
    assert not _may_import("testkit.harness", "bench.studies.realtime")
    assert not _may_import("bench.publish.figures", "bench.studies.grid")
    assert _may_import("bench.studies.grid", "bench.lib.cells")
    assert _may_import("testkit.probe", "testkit.net.stream_ws")
    assert not _may_import("testkit.harness", "bench.lib.cells")
    assert not _may_import("testkit.probe", "bench.net.verifier")
    assert not _may_import("testkit.harness", "bench")
    assert not _may_import("bench.lib.cells", "testkit.harness")
    assert _may_import("bench.lib.cells", "testkit.provenance")
    assert _may_import("bench.studies.overload", "testkit.net.wanem")
