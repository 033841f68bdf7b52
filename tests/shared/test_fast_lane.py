"""The fast lane (``make check``) is chosen by a marker, not by a list kept by hand.

A test file joins it with ``pytestmark = pytest.mark.fast`` after its imports; ``make check`` runs
``pytest -m fast``. These checks keep that honest: the marker is registered (a typo would select
nothing, silently), the Makefile runs the marker, and the lane holds at least the suites of the
session cores, the codec, the maths and the scheduler.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]

#: The suites the lane must hold: the cores of both ends, the codec and the mux, the maths, the
#: scheduler, the layer contracts, and this file.
CORE_SUITES = (
    "tests/shared/test_protocol.py",
    "tests/shared/test_mux.py",
    "tests/shared/test_maths.py",
    "tests/shared/test_imports.py",
    "tests/shared/test_fast_lane.py",
    "tests/verifier/test_verifier_core.py",
    "tests/verifier/test_scheduler.py",
    "tests/edge/test_edge_core.py",
    "tests/edge/test_federation_core.py",
    "tests/system/test_session_properties.py",
)


def _is_fast(node: ast.expr) -> bool:
    """``pytest.mark.fast``, alone or in a list or tuple of marks."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_fast(e) for e in node.elts)
    return ast.unparse(node) == "pytest.mark.fast"


def fast_files() -> list[str]:
    """The test files whose module-level ``pytestmark`` holds ``pytest.mark.fast``."""
    out = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
                and _is_fast(node.value)
            ):
                out.append(str(path.relative_to(REPO)))
    return out


def test_the_marker_is_registered(pytestconfig: pytest.Config) -> None:
    markers = pytestconfig.getini("markers")
    assert any(m.split(":")[0].strip() == "fast" for m in markers), markers


def test_make_check_runs_the_marked_files() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^check:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe is not None, "no check target in the Makefile"
    assert re.search(r"pytest\b.*-m fast\b", recipe.group(1)), recipe.group(1)


def test_the_lane_holds_the_core_suites() -> None:
    lane = fast_files()
    missing = [s for s in CORE_SUITES if s not in lane]
    assert not missing, f"not marked fast: {missing} (the lane: {lane})"


def test_the_marker_finder_reads_lists_and_ignores_others() -> None:
    tree = ast.parse("a = pytest.mark.fast\nb = [pytest.mark.slow, pytest.mark.fast]\nc = 1")
    found = [_is_fast(n.value) for n in tree.body if isinstance(n, ast.Assign)]
    assert found == [True, True, False]
