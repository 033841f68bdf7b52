"""``edge-agent chat`` driven through a pseudo-terminal (pexpect), against a live verifier."""

from __future__ import annotations

import asyncio
import io
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from edge_agent.daemon.api_errors import ApiError
from edge_agent.daemon.api_request import parse_request
from edge_agent.daemon.chat import ChatError, ChatOptions, Event, Repl
from edge_agent.daemon.progress import Progress
from edge_agent.runtime.events import Finished
from edge_agent.runtime.settings import EdgeSettings
from shared.maths.rejection import CorrectionMode
from shared.runtime.models import LoadedModel, load_model
from tests.edge_helpers import Servers, edge_settings
from tests.waits import POLL_S, poll

TOKEN_RE = r"\bt\d+"
STATS_RE = (
    r"\d+ tokens? in [\d.]+ s \([\d.]+ tok/s\) · first token [\d.]+ ms · (the cloud agreed with "
    r"\d+% of the edge's drafts|no edge draft checked) · \d+ of \d+ tokens? written by the cloud"
    r"( · round trip [\d.]+ ms)?"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("chat_servers"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def slow_verifier(servers: Servers, tiny_model_dir: Path) -> str:
    target: LoadedModel = load_model(str(tiny_model_dir))
    return servers.verifier(target, delay=0.02)  # answers take a while: streaming is visible


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_config(path: Path, verifier: str, servers: Servers, draft: Path, port: int) -> Path:
    path.write_text(
        f'verifier = "{verifier}"\ntoken_file = "{servers.token_file}"\ndraft = "{draft}"\n'
        f'device = "cpu"\nmodel_id = "tiny"\nport = {port}\nmax_tokens = 40\nthreads = 1\n'
    )
    return path


def spawn_chat(config: Path) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "edge_agent.daemon.cli", "chat", "--config", str(config)],
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )
    return child


def ask(child: pexpect.spawn, text: str) -> tuple[float, float]:
    """Send a message; returns (seconds to the first streamed token, seconds to the stats)."""
    child.expect_exact(">>> ")
    t0 = time.monotonic()
    child.sendline(text)
    child.expect_exact(text.splitlines()[-1])  # the terminal's echo
    child.expect(TOKEN_RE)
    first = time.monotonic() - t0
    child.expect(STATS_RE)
    return first, time.monotonic() - t0


def test_repl_in_process(
    tmp_path: Path, servers: Servers, slow_verifier: str, tiny_draft_dir: Path
) -> None:
    # Nothing listens on the configured port: the REPL runs the agent itself.
    config = write_config(
        tmp_path / "edge.toml", slow_verifier, servers, tiny_draft_dir, free_port()
    )
    child = spawn_chat(config)
    try:
        child.expect("in-process agent: draft [^ ]+ on cpu \\(float32, 1 thread\\)")
        first, done = ask(child, "hello there")
        # Tokens appear as they are committed, well before the answer ends.
        assert done - first > 0.3, (first, done)

        # At T = 0 /set shows the correction in effect, the one /stats reports.
        child.expect_exact(">>> ")
        child.sendline("/set")
        child.expect_exact("correction   'candidates' (greedy_draft at T = 0)")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"correction\s+greedy_draft")

        child.expect_exact(">>> ")
        child.sendline("/set temperature 0.7")
        child.expect_exact("Set temperature to 0.7.")
        child.expect_exact(">>> ")
        child.sendline("/set gamma 0")
        child.expect_exact("error: gamma must be in 1..64, got 0")
        child.expect_exact(">>> ")
        child.sendline("/set mode stop-and-wait")
        child.expect_exact("Set mode to 'stop-and-wait'.")
        child.expect_exact(">>> ")
        child.sendline("/set seed 3")
        child.expect_exact("Set seed to 3.")

        # Multi-line input, sampled at the new settings.
        child.expect_exact(">>> ")
        child.sendline('"""')
        child.expect_exact("... ")
        child.sendline("first line")
        child.expect_exact("... ")
        child.sendline('second line"""')
        child.expect(TOKEN_RE)
        child.expect(STATS_RE)

        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"mode\s+stop-and-wait")
        child.expect(r"temperature\s+0\.7")
        child.expect(r"session: 2 answers")

        # Ctrl-C stops an answer, not the REPL.
        child.expect_exact(">>> ")
        child.sendline("/set max_tokens 400")
        child.expect_exact(">>> ")
        child.sendline("tell me more")
        child.expect(TOKEN_RE)
        child.sendintr()
        child.expect_exact("(interrupted)")
        child.expect_exact(">>> ")
        child.sendline("/clear")
        child.expect_exact("Cleared session context")
        child.expect_exact(">>> ")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_repl_uses_a_running_daemon(
    tmp_path: Path, servers: Servers, slow_verifier: str, tiny_draft_dir: Path
) -> None:
    settings = edge_settings(tiny_draft_dir, slow_verifier, servers.token_file, max_tokens=20)
    base, service = servers.edge(settings)
    port = int(base.rsplit(":", 1)[1])
    config = write_config(tmp_path / "edge.toml", slow_verifier, servers, tiny_draft_dir, port)
    child = spawn_chat(config)
    try:
        child.expect_exact(f"edge-agent serve at http://127.0.0.1:{port}")
        ask(child, "hello")
        child.expect_exact(">>> ")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert (
        service.metrics.generations.get(outcome="length")
        + service.metrics.generations.get(outcome="stop")
        == 1
    )


def test_options_change_and_refuse_by_name() -> None:
    opts = ChatOptions.from_settings(EdgeSettings())
    assert opts.with_setting("top_p", "0.5").top_p == 0.5
    assert opts.with_setting("seed", "none").seed is None
    for key, value in [("top_k", "-1"), ("temperature", "hot"), ("nope", "1"), ("mode", "x")]:
        with pytest.raises(ValueError):
            opts.with_setting(key, value)
    assert opts.with_setting("gamma", "8").with_setting("gamma", "auto").gamma == "auto"
    assert EdgeSettings().pipeline(opts.with_setting("depth", "auto").request()).auto_depth


@pytest.mark.parametrize(
    ("key", "value", "ok"),
    [
        ("temperature", 2.0, True),
        ("temperature", 2.5, False),  # the REPL took up to 100, the API 2
        ("temperature", 1e-5, False),
        ("top_p", 0.0, False),
        ("top_k", 1 << 24, True),
        ("top_k", (1 << 24) + 1, False),
        ("max_tokens", 0, False),
        ("gamma", 65, False),
        ("depth", 127, True),
        ("depth", 128, False),
        ("seed", 2**64 - 1, True),
        ("seed", -1, False),
    ],
)
def test_the_repl_and_the_api_agree_on_bounds(key: str, value: float, ok: bool) -> None:
    """/set and a request body accept the same values (one declaration of the bounds)."""
    opts = ChatOptions.from_settings(EdgeSettings())
    try:
        opts.with_setting(key, str(value))
        repl_ok = True
    except ValueError:
        repl_ok = False
    body: dict[str, Any] = {key: value}
    if key in ("gamma", "depth"):
        body = {"wanspec": body}
    try:
        parse_request(body, EdgeSettings(), prompt_tokens=1, context=None)
        api_ok = True
    except ApiError:
        api_ok = False
    assert (repl_ok, api_ok) == (ok, ok)


def test_multi_line_reading() -> None:
    lines = iter(['"""one', "two", 'three"""'])
    repl = Repl.__new__(Repl)
    repl.read = lambda prompt: next(lines)
    assert repl.read_message() == "one\ntwo\nthree"
    lines = iter(['"""single"""'])
    assert repl.read_message() == "single"


def test_set_shows_the_correction_in_effect() -> None:
    greedy = ChatOptions.from_settings(
        EdgeSettings(temperature=0.0, correction=CorrectionMode.CANDIDATES)
    )
    assert greedy.wire_correction is CorrectionMode.GREEDY_DRAFT
    assert greedy.show("correction") == "'candidates' (greedy_draft at T = 0)"
    assert "correction   'candidates' (greedy_draft at T = 0)" in greedy.describe()
    sampled = greedy.with_setting("temperature", "0.7")
    assert sampled.show("correction") == "'candidates'"
    assert sampled.wire_correction is CorrectionMode.CANDIDATES
    plain = greedy.with_setting("correction", "greedy_draft")
    assert plain.show("correction") == "'greedy_draft'"


class FakeBackend:
    description = "fake"

    def __init__(self, finish_reason: str, tokens: int) -> None:
        self.finish_reason, self.tokens = finish_reason, tokens

    async def chat(self, messages: list[dict[str, str]], opts: ChatOptions) -> AsyncIterator[Event]:
        yield "an answer that goes on"
        yield Finished("an answer that goes on", self.finish_reason, 3, self.tokens, {})

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("reason", "tokens", "marker"),
    [
        ("length", 40, "[… cut at max_tokens = 40; /set max_tokens N for longer answers]"),
        ("length", 12, "[… cut at 12 tokens: the context is full; /clear to start over]"),
        ("stop", 40, None),
    ],
)
def test_a_reply_cut_by_its_length_limit_is_marked(
    reason: str, tokens: int, marker: str | None
) -> None:
    out = io.StringIO()
    opts = ChatOptions.from_settings(EdgeSettings(max_tokens=40))
    repl = Repl(FakeBackend(reason, tokens), opts, out)
    asyncio.run(repl.answer("hi"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "an answer that goes on"
    if marker is None:
        assert "cut at" not in out.getvalue()
    else:
        assert lines[1] == marker


#: An answer's statistics, as the daemon's "wanspec" object gives them.
STATS: dict[str, Any] = {
    "tokens": 10, "wall_s": 0.8125, "tokens_per_s": 12.345, "ttft_ms": 131.4, "rtt_ms": 12.0,
    "acceptance_rate": 0.75, "mean_accepted_per_round": 3.1, "rounds": 3, "rejections": 1,
    "discarded_batches": 0, "draft_tokens": 12, "accepted_tokens": 9, "uplink_bytes": 60,
    "uplink_bytes_per_round": 20.0, "downlink_bytes": 42, "downlink_bytes_per_rejection": 0.0,
    "bytes_per_token": 10.2, "mode": "pipelined", "gamma": 4, "depth": 2, "gamma_mean": 4.0,
    "depth_mean": 2.0, "verified": True,
    "token_sources": {"edge_draft": 9, "correction": 1, "bonus": 0, "cogenerated": 0},
}  # fmt: skip
PLAIN = (
    "10 tokens in 0.81 s (12.3 tok/s) · first token 131 ms · the cloud agreed with 75% of the "
    "edge's drafts · 1 of 10 tokens written by the cloud · round trip 12 ms"
)
DETAIL = (
    "pipelined γ=4 D=2 (mean 4/2) · acceptance 75%, 3.10 accepted/round over 3 rounds"
    " · 1 rejection, 0 discarded batches · up 60 B (20 B/round), down 42 B (no correction"
    " frame: co-generated tokens made the rejection known) · 10.2 B/token · tokens from:"
    " edge drafts 9 (90%), corrections 1 (10%)"
)


class StatsBackend(FakeBackend):
    async def chat(self, messages: list[dict[str, str]], opts: ChatOptions) -> AsyncIterator[Event]:
        yield "an answer"
        yield Finished("an answer", "stop", 3, 10, dict(STATS))


@pytest.mark.parametrize("verbose", [False, True])
def test_under_an_answer_plain_words_and_with_verbose_the_internals(verbose: bool) -> None:
    out = io.StringIO()
    opts = ChatOptions.from_settings(EdgeSettings())
    repl = Repl(StatsBackend("stop", 10), opts, out, verbose=verbose)
    asyncio.run(repl.answer("hi"))
    lines = out.getvalue().splitlines()
    assert lines == ["an answer", PLAIN, *([DETAIL] if verbose else [])]
    # /stats shows everything: each value, both lines, and the session so far.
    out.truncate(0)
    out.seek(0)
    assert repl.command("/stats")
    shown = out.getvalue().splitlines()
    assert "  rejections                     1" in shown
    assert shown[-3:] == [
        f"  {PLAIN}",
        f"  {DETAIL}",
        "  session: 1 answer, 10 tokens, the cloud agreed with 75% of the edge's drafts",
    ]


def test_run_chat_hands_verbose_to_the_repl(monkeypatch: pytest.MonkeyPatch) -> None:
    """``edge-agent chat -v`` (cli.py hands it to run_chat): the REPL it runs is verbose."""
    import edge_agent.daemon.chat as chat

    async def open_backend(s: EdgeSettings, progress: Progress) -> tuple[Any, list[str]]:
        return FakeBackend("stop", 1), []

    seen: list[bool] = []

    def run(self: Repl, loop: asyncio.AbstractEventLoop) -> int:
        seen.append(self.verbose)
        return 0

    monkeypatch.setattr(chat, "open_backend", open_backend)
    monkeypatch.setattr(Repl, "run", run)
    for verbose in (False, True):
        out = io.StringIO()
        assert chat.run_chat(EdgeSettings(), out, Progress(stream=out), verbose=verbose) == 0
    assert seen == [False, True]


def test_a_message_that_is_not_text_is_refused_before_it_joins_the_conversation() -> None:
    """A terminal line with a byte that is not UTF-8 (U+DCxx after surrogateescape, or a
    UnicodeDecodeError where stdin decodes strictly) is refused by the REPL itself: no backend
    call, no history entry, no traceback; later messages go on; /set system refuses such a
    prompt too."""
    calls: list[list[dict[str, str]]] = []

    class Recording(FakeBackend):
        async def chat(
            self, messages: list[dict[str, str]], opts: ChatOptions
        ) -> AsyncIterator[Event]:
            calls.append(list(messages))
            async for ev in super().chat(messages, opts):
                yield ev

    out = io.StringIO()
    repl = Repl(Recording("stop", 3), ChatOptions.from_settings(EdgeSettings()), out)
    # As a surrogateescape terminal gives such a line, and as a strict one fails to.
    strict = UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte")
    lines = iter(["caf\udce9", strict, "hi"])

    def read(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        if isinstance(line, UnicodeDecodeError):
            raise line
        return line

    repl.read = read
    loop = asyncio.new_event_loop()
    try:
        assert repl.run(loop) == 0
    finally:
        loop.close()
    assert "error: the message is not UTF-8: byte 0xe9 at character 3" in out.getvalue()
    assert "error: the line is not utf-8: byte 0xe9" in out.getvalue()
    assert calls == [[{"role": "user", "content": "hi"}]]
    assert [m["content"] for m in repl.history] == ["hi", "an answer that goes on"]
    with pytest.raises(ValueError, match="the system prompt holds a lone UTF-16 surrogate"):
        repl.opts.with_setting("system", "be \ud800 brief")


def test_an_answer_that_is_only_an_error_does_not_join_the_conversation() -> None:
    """A 503 or a full context before any token leaves the history as it was (the next turn
    must not carry the failed message); an answer cut by an error after some text keeps what
    was shown."""

    class Failing(FakeBackend):
        def __init__(self, shown: list[str]) -> None:
            super().__init__("stop", 1)
            self.shown = shown

        async def chat(
            self, messages: list[dict[str, str]], opts: ChatOptions
        ) -> AsyncIterator[Event]:
            for part in self.shown:
                yield part
            raise ChatError("503: verifier_unavailable")

    opts = ChatOptions.from_settings(EdgeSettings())
    repl = Repl(Failing([]), opts, io.StringIO())
    with pytest.raises(ChatError):
        asyncio.run(repl.answer("first"))
    assert repl.history == []
    repl = Repl(Failing(["half an"]), opts, io.StringIO())
    with pytest.raises(ChatError):
        asyncio.run(repl.answer("second"))
    assert repl.history == [
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "half an"},
    ]


def test_the_spinner_turns_at_once() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    progress = Progress(stream=stream)
    progress.report("starting")
    progress.start()
    try:
        assert "starting (0 s)" in stream.getvalue()  # drawn before start() returns
        progress.report("loading")
        # animated by its own thread
        poll(lambda: "loading" in stream.getvalue(), 5.0, "the spinner redrawn", POLL_S)
    finally:
        progress.stop(True)
    assert stream.getvalue().endswith("\n") and "✓ loading" in stream.getvalue()
    progress.stop(True)  # stopping twice is harmless


# Reports (on stderr) the moment the process starts importing torch.
_TORCH_SPY = """
import sys
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.stderr.write("<<importing torch>>\\n"); sys.stderr.flush()
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Spy())
from edge_agent.daemon.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_chat_shows_the_spinner_before_the_heavy_imports(
    tmp_path: Path, servers: Servers, tiny_draft_dir: Path
) -> None:
    config = write_config(
        tmp_path / "edge.toml", "ws://127.0.0.1:9/v1/session", servers, tiny_draft_dir, free_port()
    )
    child = pexpect.spawn(
        sys.executable,
        ["-c", _TORCH_SPY, "chat", "--config", str(config)],
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )
    try:
        first = child.expect_exact(["starting edge-agent chat", "<<importing torch>>"])
        assert first == 0, child.before
        child.expect_exact("<<importing torch>>")
    finally:
        child.close(force=True)
