"""``edge-agent chat``: an interactive REPL in the manner of ``ollama run``.

``>>>`` prompt; ``\"\"\"`` starts and ends multi-line input; ``/set KEY VALUE`` changes a sampling
or speculation setting, ``/set`` alone shows them; ``/clear`` forgets the conversation; ``/stats``
shows the last answer's speculative statistics; ``/bye`` (or Ctrl-D) leaves. Ctrl-C interrupts a
generation, not the REPL.

Backends: a running ``edge-agent serve`` on the configured address (over its OpenAI API), else an
:class:`~edge_agent.runtime.service.EdgeService` in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Protocol, TextIO

import aiohttp

from edge_agent.daemon.progress import Progress, check_cuda, quiet_hub_progress
from edge_agent.daemon.unicode_text import text_error
from edge_agent.runtime.events import Failed, FailureKind, Finished, Piece
from edge_agent.runtime.loading import loading_line
from edge_agent.runtime.report import detail_line, plain_line, plural
from edge_agent.runtime.service import EdgeService, GenRequest
from edge_agent.runtime.settings import (
    EdgeSettings,
    check_link_files,
    check_model_specs,
    read_secret_file,
)
from edge_agent.runtime.text import NoChatTemplate, encode_chat
from edge_agent.session.pipeline_config import Auto, Bounds, Mode, PipelineConfig, RequestOptions
from shared.errors import WanspecError
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams

HELP = f"""Available commands:
  /set               Show the current settings
  /set KEY VALUE     Change a setting: temperature, top_p, top_k, max_tokens, seed (none to
                     unset), gamma, depth (auto or a number), mode ({"|".join(Mode.choices())}),
                     correction ({"|".join(CorrectionMode.choices())}), system (a system prompt)
  /stats             Statistics of the last answer (and of this session)
  /clear             Clear the conversation
  /bye               Exit
  /?, /help          This help

Use \"\"\" to begin and end a multi-line message. Ctrl-C stops an answer."""


class ChatError(WanspecError, RuntimeError):
    """A generation failed (the message says why); the REPL goes on."""


@dataclass(frozen=True)
class ChatOptions:
    """The REPL's generation settings: the daemon's defaults (:meth:`from_settings`, same names),
    changed by ``/set``."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int | None
    gamma: int | Auto
    depth: int | Auto
    mode: Mode
    correction: CorrectionMode
    system: str = ""

    @classmethod
    def from_settings(cls, s: EdgeSettings) -> ChatOptions:
        return cls(**{f.name: getattr(s, f.name) for f in fields(cls) if f.name != "system"})

    def request(self) -> RequestOptions:
        """These values as a request's own (for ``EdgeSettings.pipeline``)."""
        return RequestOptions(**{f.name: getattr(self, f.name) for f in fields(RequestOptions)})

    def with_setting(self, key: str, value: str) -> ChatOptions:
        """A copy with ``key`` set from text; ValueError with a message for the user."""
        names = {f.name for f in fields(self)}
        if key not in names:
            raise ValueError(f"unknown setting {key!r}; one of {', '.join(sorted(names))}")
        if key == "system":
            err = text_error(value)
            if err is not None:
                raise ValueError(f"the system prompt {err}")
            return replace(self, system=value)
        if key == "mode":
            return replace(self, mode=Mode.parse(value, "mode"))
        if key == "correction":
            return replace(self, correction=CorrectionMode.parse(value, "correction"))
        if key == "seed" and value.lower() in ("none", "off", ""):
            return replace(self, seed=None)
        changes: dict[str, Any] = {}
        if key in ("gamma", "depth") and value.lower() == "auto":
            changes[key] = "auto"
            return replace(self, **changes)
        bound = Bounds.of(key)  # the API's (and the daemon defaults')
        try:
            num: float | int = float(value) if isinstance(bound.lo, float) else int(value)
        except ValueError:
            raise ValueError(f"{key} needs a number, got {value!r}") from None
        if num not in bound:
            raise ValueError(f"{key} must be {bound.words()}, got {value}")
        changes[key] = num
        return replace(self, **changes)

    @property
    def wire_correction(self) -> CorrectionMode:
        """The correction the verifier is asked for: greedy decoding (T = 0) always uses
        greedy_draft (:attr:`PipelineConfig.wire_correction`), whatever ``correction`` says."""
        sampling = SamplingParams(self.temperature, self.top_k, self.top_p)
        return PipelineConfig(correction=self.correction, sampling=sampling).wire_correction

    def show(self, key: str) -> str:
        """One setting as the REPL prints it (a mode as its plain value: 'pipelined'); the
        correction with the one in effect when they differ: "'candidates' (greedy_draft at
        T = 0)", as /stats reports it."""
        value = getattr(self, key)
        text = repr(value.value if isinstance(value, Enum) else value)
        if key == "correction" and self.wire_correction != self.correction:
            text += f" ({self.wire_correction.value} at T = 0)"
        return text

    def describe(self) -> str:
        return "\n".join(f"  {f.name:<12} {self.show(f.name)}" for f in fields(self))


Event = str | Finished


class Backend(Protocol):
    description: str

    def chat(self, messages: list[dict[str, str]], opts: ChatOptions) -> AsyncIterator[Event]: ...

    async def close(self) -> None: ...


# ---------------------------------------------------------------------------- backends


class RemoteBackend:
    """A running ``edge-agent serve``, over its OpenAI-compatible API (SSE streaming)."""

    def __init__(self, base_url: str, api_key: str | None, model: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
        )
        self.description = f"edge-agent serve at {self.base_url}"

    async def close(self) -> None:
        await self.session.close()

    async def chat(self, messages: list[dict[str, str]], opts: ChatOptions) -> AsyncIterator[Event]:
        body = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": opts.temperature,
            "top_p": opts.top_p,
            "top_k": opts.top_k,
            "max_tokens": opts.max_tokens,
            "seed": opts.seed,
            "wanspec": {
                k: v
                for k, v in (
                    ("gamma", opts.gamma),
                    ("depth", opts.depth),
                    ("mode", opts.mode.value),
                    ("correction", opts.correction.value),
                )
                if v != "auto"  # the daemon's own choice
            },
        }
        parts: list[str] = []
        finish = "stop"
        stats: dict[str, Any] = {}
        usage: dict[str, Any] = {}
        async with self.session.post(f"{self.base_url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise ChatError(_error_text(resp.status, await resp.text()))
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ChatError(chunk["error"].get("message", "error"))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if "wanspec" in chunk:
                    stats = chunk["wanspec"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        parts.append(text)
                        yield text
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
        yield Finished(
            text="".join(parts),
            finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens") or stats.get("tokens") or 0),
            stats=stats,
        )


def _error_text(status: int, text: str) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return f"{status}: {json.loads(text)['error']['message']}"
    return f"{status}: {text.strip()[:200]}"


class LocalBackend:
    """The agent in this process (nothing answered on the configured address)."""

    def __init__(self, service: EdgeService) -> None:
        self.service = service
        urls = ", ".join(service.settings.verifier_urls)
        self.description = f"in-process agent: {service.describe()} → {urls}"

    async def close(self) -> None:
        await self.service.close()

    async def chat(self, messages: list[dict[str, str]], opts: ChatOptions) -> AsyncIterator[Event]:
        loaded, _ = self.service.require()
        try:
            prompt = encode_chat(loaded, messages, hint="the chat needs a chat model's draft")
        except NoChatTemplate as e:
            raise ChatError(str(e)) from None
        try:
            pipeline = self.service.settings.pipeline(opts.request())
        except ValueError as e:
            raise ChatError(str(e)) from None
        context = self.service.context_limit()
        limit = context.tokens
        max_tokens = opts.max_tokens
        if limit is not None:
            if len(prompt) >= limit:
                raise ChatError(
                    f"the conversation ({len(prompt)} tokens) fills the context: "
                    f"{context.words('is')}; /clear"
                )
            max_tokens = min(max_tokens, limit - len(prompt))
        req = GenRequest(prompt, pipeline, max_tokens, seed=opts.seed)
        async with contextlib.aclosing(self.service.stream(req)) as events:
            async for ev in events:
                if isinstance(ev, Piece):
                    yield ev.text
                elif isinstance(ev, Finished):
                    yield ev
                elif isinstance(ev, Failed) and ev.kind == FailureKind.PROMPT_TOO_LONG:
                    # a verifier reached only now: its context is smaller
                    raise ChatError(f"the conversation does not fit: {ev.message}; /clear")
                elif isinstance(ev, Failed):
                    raise ChatError(ev.message)


async def probe_server(base_url: str, api_key: str | None) -> str | None:
    """``"ready"``, ``"loading"``, ``"unavailable"`` if an edge-agent answers; None if nothing."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=3)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout, headers=headers) as s,
            s.get(f"{base_url}/health") as resp,
        ):
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        return None
    if not isinstance(body, dict) or "link" not in body:
        return None  # something else listens there
    status = body.get("status")
    if resp.status == 200:
        return "ready"
    return "loading" if status == "loading" else "unavailable"


def server_url(s: EdgeSettings) -> str:
    return s.api_url


async def open_backend(s: EdgeSettings, progress: Progress) -> tuple[Backend, list[str]]:
    """A running daemon's API, else the agent in this process (loaded here); and the notes to
    show once the spinner line is done. ``progress`` says what is going on meanwhile."""
    notes: list[str] = []
    api_key = read_secret_file(s.api_key_file, "api_key_file") if s.api_key_file else None
    url = server_url(s)
    progress.report(f"looking for edge-agent serve at {url}")
    state = await probe_server(url, api_key)
    while state == "loading":
        progress.report(f"waiting for edge-agent serve at {url} to load its model")
        await asyncio.sleep(2)
        state = await probe_server(url, api_key)
    if state is not None:
        if state == "unavailable":
            notes.append(f"warning: edge-agent serve at {url} reaches no verifier")
        return RemoteBackend(url, api_key, s.model_id), notes
    # Nothing answers there: this process runs the agent. Cheap checks first, then torch.
    check_model_specs(s)
    check_link_files(s)
    progress.report(loading_line(s))
    quiet_hub_progress()
    if s.threads is not None:
        import torch

        torch.set_num_threads(s.threads)
    warning = check_cuda(s.device)
    if warning:
        notes.append(f"warning: {warning}")
    service = EdgeService(s)
    try:
        await service.load(progress.report)
        return LocalBackend(service), notes
    except BaseException:
        await service.close()
        raise


# ---------------------------------------------------------------------------- the REPL


class Repl:
    """The REPL over ``backend``. Under each answer, one dim line of statistics in plain words
    (:func:`~edge_agent.runtime.report.plain_line`); ``verbose`` (``edge-agent chat -v``, as
    ``ollama run --verbose``): the speculation's internals on a second line
    (:func:`~edge_agent.runtime.report.detail_line`), which ``/stats`` always shows."""

    def __init__(
        self,
        backend: Backend,
        opts: ChatOptions,
        out: TextIO,
        read: Callable[[str], str] = input,
        *,
        verbose: bool = False,
    ) -> None:
        self.backend = backend
        self.opts = opts
        self.out = out
        self.read = read
        self.verbose = verbose
        self.history: list[dict[str, str]] = []
        self.last: dict[str, Any] | None = None
        self.totals = {"answers": 0, "tokens": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.dim = out.isatty()

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.dim else text

    def read_message(self) -> str:
        """One message; ``\"\"\"`` begins and ends a multi-line one."""
        line = self.read(">>> ")
        if not line.lstrip().startswith('"""'):
            return line
        body = line.lstrip()[3:]
        if body.rstrip().endswith('"""') and body.strip():
            return body.rstrip()[:-3]
        lines = [body] if body else []
        while True:
            more = self.read("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(more)

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        cmd, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if cmd in ("/bye", "/exit", "/quit"):
            return False
        if cmd in ("/?", "/help"):
            self.say(HELP)
        elif cmd == "/clear":
            self.history.clear()
            self.say("Cleared session context")
        elif cmd in ("/set", "/show"):
            if not rest:
                self.say(self.opts.describe())
            else:
                key, _, value = rest.partition(" ")
                try:
                    self.opts = self.opts.with_setting(key, value.strip())
                except ValueError as e:
                    self.say(f"error: {e}")
                else:
                    self.say(f"Set {key} to {self.opts.show(key)}.")
        elif cmd == "/stats":
            self.show_stats()
        else:
            self.say(f"Unknown command {cmd!r}. Type /? for help.")
        return True

    def show_stats(self) -> None:
        if self.last is None:
            self.say("No answer yet.")
            return
        for k, v in self.last.items():
            self.say(f"  {k:<30} {v}")
        self.say(f"  {plain_line(self.last)}")
        self.say(f"  {detail_line(self.last)}")
        t = self.totals
        if self.last.get("cloud_only"):
            speculation = "the cloud drafted for itself"
        elif t["draft_tokens"]:
            share = t["accepted_tokens"] / t["draft_tokens"]
            speculation = f"the cloud agreed with {share:.0%} of the edge's drafts"
        else:
            speculation = "no edge draft checked"
        answers, tokens = plural(t["answers"], "answer"), plural(t["tokens"], "token")
        self.say(f"  session: {answers}, {tokens}, {speculation}")

    def cut_note(self, tokens: int) -> str:
        """The marker under an answer that stopped at its length limit, not at its end."""
        if tokens < self.opts.max_tokens:
            return (
                f"[… cut at {plural(tokens, 'token')}: the context is full; /clear to start over]"
            )
        return f"[… cut at max_tokens = {tokens}; /set max_tokens N for longer answers]"

    def messages(self, text: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.opts.system}] if self.opts.system else []
        return [*system, *self.history, {"role": "user", "content": text}]

    async def answer(self, text: str) -> None:
        """Stream one answer. The exchange joins the conversation when the answer ends or once
        any of it was shown (what the user saw stays, even when interrupted); a message that
        got only an error (a refusal, no verifier, a full context) does not, so the next turn
        does not carry it."""
        parts: list[str] = []
        finished = False
        try:
            async for ev in self.backend.chat(self.messages(text), self.opts):
                if isinstance(ev, Finished):
                    self.say()
                    if ev.finish_reason == "length":
                        self.say(self._dim(self.cut_note(ev.completion_tokens)))
                    self.last = ev.stats
                    t = self.totals
                    t["answers"] += 1
                    t["tokens"] += ev.completion_tokens
                    t["draft_tokens"] += int(ev.stats.get("draft_tokens") or 0)
                    t["accepted_tokens"] += int(ev.stats.get("accepted_tokens") or 0)
                    self.say(self._dim(plain_line(ev.stats)))
                    if self.verbose:
                        self.say(self._dim(detail_line(ev.stats)))
                    finished = True
                else:
                    parts.append(ev)
                    self.out.write(ev)
                    self.out.flush()
        finally:
            if finished or parts:
                self.history.append({"role": "user", "content": text})
                self.history.append({"role": "assistant", "content": "".join(parts)})

    def run(self, loop: asyncio.AbstractEventLoop) -> int:
        self.say(self._dim(f"edge-agent chat · {self.backend.description} · /? for help"))
        while True:
            try:
                text = self.read_message()
            except EOFError:
                self.say()
                return 0
            except KeyboardInterrupt:
                self.say("\nUse Ctrl + d or /bye to exit.")
                continue
            except UnicodeDecodeError as e:  # a terminal whose stdin decodes strictly
                self.say(f"error: the line is not {e.encoding}: byte 0x{e.object[e.start]:02x}")
                continue
            if not text.strip():
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return 0
                continue
            err = text_error(text)
            if err is not None:  # refused here, so it never joins the conversation
                self.say(f"error: the message {err}")
                continue
            task = loop.create_task(self.answer(text))
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGINT, task.cancel)
            try:
                loop.run_until_complete(task)
            except asyncio.CancelledError:
                self.say("\n" + self._dim("(interrupted)"))
            except (ChatError, aiohttp.ClientError, OSError) as e:
                self.say(f"\nerror: {e}")
            finally:
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(signal.SIGINT)


def run_chat(
    settings: EdgeSettings,
    out: TextIO | None = None,
    progress: Progress | None = None,
    *,
    verbose: bool = False,
) -> int:
    """The REPL until /bye or Ctrl-D. ``progress``: a spinner already started (``edge-agent
    chat`` starts one before it imports this module), else one is made here; ``verbose``:
    each answer's statistics with their internals (:class:`Repl`)."""
    out = out or sys.stdout
    progress = progress or Progress()
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    loop = asyncio.new_event_loop()
    try:
        progress.start()
        try:
            backend, notes = loop.run_until_complete(open_backend(settings, progress))
        except BaseException:
            progress.stop(False)
            raise
        progress.stop(True)
        for note in notes:
            print(note, file=sys.stderr, flush=True)
        try:
            opts = ChatOptions.from_settings(settings)
            return Repl(backend, opts, out, verbose=verbose).run(loop)
        finally:
            loop.run_until_complete(backend.close())
    finally:
        loop.close()
