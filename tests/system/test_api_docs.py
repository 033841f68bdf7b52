"""The HTTP APIs and their docs agree: every route of the edge daemon and of the verifier is
documented, and docs/edge/api.md's table of request keys is the parser's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from aiohttp import web

from cloud_verifier.daemon.app import build_app as verifier_app
from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.settings import VerifierSettings
from edge_agent.daemon.api_request import request_keys_markdown
from edge_agent.daemon.server import build_app as edge_app
from edge_agent.runtime.service import EdgeService
from edge_agent.runtime.settings import EdgeSettings

REPO = Path(__file__).resolve().parents[2]
API_DOC = REPO / "docs" / "edge" / "api.md"
KEYS_BLOCK = re.compile(r"<!-- request-keys:[^\n]*-->\n(.*?)<!-- /request-keys -->", re.S)


def routes(app: web.Application) -> list[str]:
    """``METHOD /path`` of each route (aiohttp's implicit HEAD of a GET left out)."""
    out = []
    for route in app.router.routes():
        resource = route.resource
        if route.method == "HEAD" or resource is None:
            continue
        out.append(f"{route.method} {resource.canonical}")
    return out


def docs_text(folder: str) -> str:
    return "\n".join(p.read_text() for p in sorted((REPO / "docs" / folder).glob("*.md")))


def documented(route: str, text: str) -> bool:
    """``route`` ("GET /v1/models") is named in ``text``: not as the start of a longer path
    ("GET /" is not named by "GET /health")."""
    return re.search(rf"\b{re.escape(route)}(?![\w/{{}}-])", text) is not None


def undocumented(app: web.Application, folder: str) -> list[str]:
    text = docs_text(folder)
    return [r for r in routes(app) if not documented(r, text)]


@pytest.mark.fast
def test_a_route_is_named_whole() -> None:
    assert documented("GET /", "answers `GET /` with") and documented("GET /", "GET /.")
    assert not documented("GET /", "`GET /health`")
    assert not documented("GET /v1/models", "`GET /v1/models/{model}`")
    assert documented("GET /v1/models/{model}", "| `GET /v1/models/{model}` |")
    assert not documented("POST /api/chat", "`GET /api/chat`")


@pytest.mark.fast
def test_every_edge_route_is_documented() -> None:
    """Each route of ``edge-agent serve`` appears as `METHOD /path` in docs/edge/*.md."""
    app = edge_app(EdgeService(EdgeSettings()))
    found = routes(app)
    assert {"POST /v1/chat/completions", "GET /v1/models/{model}", "GET /health"} <= set(found)
    assert undocumented(app, "edge") == []


@pytest.mark.fast
def test_every_verifier_route_is_documented() -> None:
    """Each route of ``cloud-verifier serve`` appears as `METHOD /path` in docs/cloud/*.md."""
    app = verifier_app(VerifierSettings(), auth=Authenticator(["t" * 32]))
    assert "GET /v1/session" in routes(app)
    assert undocumented(app, "cloud") == []


@pytest.mark.fast
def test_the_docs_table_of_request_keys_is_the_parsers() -> None:
    m = KEYS_BLOCK.search(API_DOC.read_text())
    assert m is not None, "docs/edge/api.md lost its request-keys markers"
    assert m.group(1) == request_keys_markdown(), (
        "docs/edge/api.md's request keys differ from REQUEST_KEYS; paste the output of\n"
        "  .venv/bin/python -c 'from edge_agent.daemon.api_request import request_keys_markdown;"
        ' print(request_keys_markdown(), end="")\'\nbetween its request-keys markers'
    )
