"""The edge runtime's one stream of events (``edge_agent/runtime/events.py``), as a front door
reads it: every stream ends in exactly one Finished or one Failed, no exception crosses it, the
failures come as a closed set of kinds (with what was generated before), and the facts a front
door needs (text, log-probabilities, round trips, waits) are on the stream and nowhere else."""

from __future__ import annotations

import asyncio
import inspect
import itertools
from pathlib import Path
from typing import Any

import pytest

from cloud_verifier.engine.targets import TorchTarget
from edge_agent.runtime import service as service_module
from edge_agent.runtime.agent import AgentEvent, EdgeAgent, Ended, RetryPolicy, SessionFailed
from edge_agent.runtime.events import (
    Failed,
    FailureKind,
    Finished,
    Piece,
    RoundTrip,
    RuntimeEvent,
    Waiting,
)
from edge_agent.runtime.service import EdgeService, GenRequest
from edge_agent.runtime.settings import EdgeSettings
from edge_agent.session.events import Committed
from edge_agent.session.pipeline_config import RequestOptions
from edge_agent.session.retry import WaitCause
from shared.runtime.models import LoadedModel
from tests.verifiers import serve_verifier, session_url

TOKEN = "runtime-events-token-0123456789"
PROMPT = [5, 6, 7, 8]


async def _verifier(aiohttp_server: Any, target: LoadedModel, **kw: Any) -> str:
    server = await serve_verifier(aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN], **kw)
    return session_url(server)


def _settings(draft_dir: Path, url: str, token_file: Path, **kw: Any) -> EdgeSettings:
    base: dict[str, Any] = {
        "verifier": url,
        "token_file": token_file,
        "draft": str(draft_dir),
        "device": "cpu",
        "heartbeat": 5.0,
        "probe_interval": 0,
    }
    return EdgeSettings(**{**base, **kw})


async def _events(service: EdgeService, req: GenRequest) -> list[RuntimeEvent]:
    return [ev async for ev in service.stream(req)]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


async def test_a_stream_ends_in_one_finished_with_what_its_pieces_carried(
    aiohttp_server: Any, target: LoadedModel, tiny_draft_dir: Path, token_file: Path
) -> None:
    url = await _verifier(aiohttp_server, target)
    service = EdgeService(_settings(tiny_draft_dir, url, token_file))
    await service.load()
    try:
        cfg = service.settings.pipeline(RequestOptions(temperature=0.0))
        req = GenRequest(PROMPT, dataclass_replace(cfg, logprobs=2), 12, ignore_eos=True)
        events = await _events(service, req)
    finally:
        await service.close()
    ends = [ev for ev in events if isinstance(ev, (Finished, Failed))]
    assert len(ends) == 1 and ends[0] is events[-1] and isinstance(ends[0], Finished)
    done = ends[0]
    pieces = [ev for ev in events if isinstance(ev, Piece)]
    assert "".join(p.text for p in pieces) == done.text and done.completion_tokens == 12
    # Every token's log-probability came with the piece that first showed its text (or the
    # end): the stream carries them, in order, and the Finished repeats them all.
    streamed = [t for p in pieces for t in p.tokens]
    assert len(done.logprobs) == 12 and streamed == list(done.logprobs[: len(streamed)])
    assert all(t.logprob is not None for t in done.logprobs)
    # The session's first round trip is on the stream, before the first piece, and it is the
    # one the statistics report.
    rtts = [ev for ev in events if isinstance(ev, RoundTrip)]
    assert rtts and events.index(rtts[0]) < events.index(pieces[0])
    assert done.stats["rtt_ms"] == round(1000 * min(r.seconds for r in rtts), 2)


def dataclass_replace(cfg: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


async def test_no_verifier_is_a_failed_event_with_its_wait_and_the_text_so_far(
    tiny_draft_dir: Path, token_file: Path
) -> None:
    """Nothing listens on the verifier's port: the request waits ``verifier_wait``, the stream
    says it waits (down) and ends in one Failed of kind NO_VERIFIER, with a Retry-After and
    what it had made (nothing); no exception reaches the reader."""
    service = EdgeService(
        _settings(tiny_draft_dir, "ws://127.0.0.1:9/v1/session", token_file, verifier_wait=0.6)
    )
    await service.load()
    try:
        cfg = service.settings.pipeline(RequestOptions(temperature=0.0))
        events = await asyncio.wait_for(_events(service, GenRequest(PROMPT, cfg, 8)), 30)
    finally:
        await service.close()
    assert isinstance(events[-1], Failed)
    failed = events[-1]
    assert failed.kind == FailureKind.NO_VERIFIER and failed.retry_after is not None
    assert "verifier_wait" in failed.message
    assert failed.partial is not None and failed.partial.completion_tokens == 0
    assert failed.partial.text == "" and failed.partial.stats["tokens"] == 0
    waits = [ev for ev in events if isinstance(ev, Waiting)]
    assert [w.cause for w in waits] == [WaitCause.DOWN]  # told once: its cause never changed
    assert not any(isinstance(ev, (Piece, Finished)) for ev in events)
    assert service.monitor.state == "down"


async def test_a_prompt_the_verifier_cannot_hold_is_a_failed_event(
    aiohttp_server: Any, target: LoadedModel, tiny_draft_dir: Path, token_file: Path
) -> None:
    url = await _verifier(aiohttp_server, target, max_context=32)
    service = EdgeService(_settings(tiny_draft_dir, url, token_file))
    await service.load()
    try:
        cfg = service.settings.pipeline(RequestOptions(temperature=0.0))
        events = await _events(service, GenRequest([5] * 40, cfg, 4))
    finally:
        await service.close()
    assert [type(ev) for ev in events] == [Failed]
    assert events[0].kind == FailureKind.PROMPT_TOO_LONG  # type: ignore[union-attr]


async def test_a_full_line_is_said_before_any_text(tiny_draft_dir: Path, token_file: Path) -> None:
    """``admission`` answers what a request arriving now would meet (a front door that must
    choose its status before its first byte asks it): a QUEUE_FULL with a Retry-After once
    every place is held and the line is full, nothing otherwise."""
    settings = _settings(
        tiny_draft_dir, "ws://127.0.0.1:9/v1/session", token_file, max_queue=1, max_concurrent=1
    )
    service = EdgeService(settings)
    try:
        assert service.admission() is None
        async with service.queue.slot():
            assert service.admission() is None  # one may wait
            waiter = asyncio.ensure_future(_hold(service))
            await asyncio.sleep(0)  # (it joins the line)
            refused = service.admission()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
    finally:
        await service.close()
    assert refused is not None and refused.kind == FailureKind.QUEUE_FULL
    assert refused.retry_after is not None and refused.partial is None


async def _hold(service: EdgeService) -> None:
    async with service.queue.slot():
        await asyncio.Event().wait()


async def test_a_run_tells_its_caller_everything_by_events_and_ends_with_ended(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """The agent's own stream, below the service: Committed (their ids are the text), the first
    round trip, every failed session with its cause, and last an Ended with the summary,
    however the run ends; the caller holds no generation."""
    from edge_agent.link.connection import LinkSettings, WebSocketTransport
    from edge_agent.model.drafter import Drafter
    from edge_agent.session.pipeline_config import PipelineConfig
    from edge_agent.session.transport import Transport
    from shared.maths.sampling import SamplingParams

    url = await _verifier(aiohttp_server, target)
    attempts = itertools.count()

    async def connect() -> Transport:
        if next(attempts) == 0:  # the first attempt finds nobody
            raise OSError("connection refused")
        return await WebSocketTransport.connect(LinkSettings(url=url, token=TOKEN, heartbeat_s=0))

    agent = EdgeAgent(
        Drafter(draft), draft.fingerprint, connect, retry=RetryPolicy(backoff_initial_s=0.01)
    )
    seen: list[AgentEvent] = []
    cfg = PipelineConfig(sampling=SamplingParams(0.0))
    run = agent.start(PROMPT, cfg, max_tokens=10)
    try:
        await asyncio.wait_for(run.go(seen.append), 60)
    finally:
        agent.close()
    failed = [ev for ev in seen if isinstance(ev, SessionFailed)]
    assert len(failed) == 1 and failed[0].cause == WaitCause.DOWN
    assert "refused" in failed[0].detail
    assert isinstance(seen[-1], Ended) and sum(isinstance(ev, Ended) for ev in seen) == 1
    summary = seen[-1].summary
    ids = [t for ev in seen if isinstance(ev, Committed) for t in ev.ids]
    assert ids == list(summary.generated) and summary.finish_reason in ("stop", "length")
    assert summary.stats.reconnects == 1
    assert any(isinstance(ev, RoundTrip) for ev in seen)


def test_the_runtime_shares_no_generation_and_reads_no_causes() -> None:
    """The three back channels the runtime once had are gone for good: the service never holds
    a Generation, never inspects an exception's cause and has no context variable."""
    source = inspect.getsource(service_module)
    assert "__cause__" not in source and "ContextVar" not in source
    assert "Generation(" not in source and "import Generation" not in source
