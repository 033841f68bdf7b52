"""One exception root: every exception class the product defines derives from WanspecError
(besides the standard class that says what kind of failure it is); Error frames' codes are
ErrorCode members, and the ones after which reconnecting cannot help are named once."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from shared.errors import FATAL_CODES, ErrorCode, WanspecError

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("shared", "edge_agent", "cloud_verifier")


def product_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for pkg in PRODUCT:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            dotted = ".".join(path.relative_to(REPO).with_suffix("").parts)
            module = importlib.import_module(dotted)
            for _, obj in inspect.getmembers(module, inspect.isclass):
                if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                    found.append(obj)
    return found


def test_every_product_exception_has_the_one_root() -> None:
    found = product_exceptions()
    assert len(found) >= 20
    orphans = [f"{c.__module__}.{c.__name__}" for c in found if not issubclass(c, WanspecError)]
    assert not orphans, f"derive these from shared.errors.WanspecError: {orphans}"


def test_one_class_per_name() -> None:
    names = [c.__name__ for c in product_exceptions()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_error_codes_are_the_wire_strings() -> None:
    assert ErrorCode.BAD_SEQ == "bad_seq" and f"{ErrorCode.RATE_LIMITED}" == "rate_limited"
    assert set(ErrorCode) >= FATAL_CODES
