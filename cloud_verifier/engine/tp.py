"""Tensor parallelism: one target model over N ranks, with transformers' own TP machinery.

    cloud-verifier serve --tp 2 ...                                # re-launches itself:
    torchrun --standalone --nproc-per-node 2 -m cloud_verifier.daemon.cli serve --tp 2 ...

torchrun starts N processes (ranks). Every rank loads its shards of the model
(``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``: attention heads, KV
heads, MLP and vocabulary split over the ranks; each layer all-reduces in its forward, the lm head
gathers, so every rank ends a forward with the full logits). Only rank 0 runs the service: the
aiohttp handler, the session cores, the scheduler and the KV pool's page bookkeeping. The other
ranks (*followers*) run the same batched forwards, in the same order, on their own shards of the
KV pool (the same pages, each holding its ranks' KV heads):

* rank 0's target (:class:`ShardedTarget`) sends each command to the followers before running it
  itself: ``ALLOCATE`` (the pool's size), ``FORWARD`` (the step's rows: start, ids, logits rows
  kept, page list each; the only per-step message, a few hundred bytes), ``HEARTBEAT`` (every few
  seconds while idle, so a follower's wait has a deadline) and ``STOP`` (shutdown);
* a follower (:func:`follow`) receives and runs them until ``STOP``.

Commands travel as int64 tensors over a gloo group (no pickle), whatever the model's own backend
(NCCL on GPUs). Everything the forward reads is in the rows; rollbacks and frees are rank 0's
bookkeeping only (a later forward's page lists carry their result).

Life: every rank initialises the process group, loads the model and meets the others at a
barrier; rank 0 reports ready (``/health`` 200) only after it, so ``/health`` is 503 until every
rank is ready. Rank 0's shutdown ends with ``STOP``: all ranks exit together. A rank that dies
ends the group: torchrun stops the others and exits non-zero (systemd restarts the service); a
follower that hears nothing for ``timeout_s`` (rank 0 hung) fails its wait and exits the same way.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any, Final

import torch
import torch.distributed as dist

from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import PagedKV, SlotPages
from shared.wire.messages import Fingerprint

log = logging.getLogger(__name__)

#: The deadline of any wait between ranks: a follower's wait for its next command (rank 0
#: sends a heartbeat every quarter of it while idle) and the post-load barrier (the ranks load
#: at the same time; the slowest may lag by a large model's shard load). A rank 0 that hangs
#: while alive is the systemd watchdog's to stop (WatchdogSec), long before this.
DEFAULT_TIMEOUT_S: Final = 600.0


class Command(IntEnum):
    ALLOCATE = 1  # payload: [num_pages, page_size]
    FORWARD = 2  # payload: the rows (encode_rows)
    HEARTBEAT = 3
    STOP = 4


@dataclass(frozen=True)
class Rank:
    """This process's place in a torchrun group (its environment)."""

    rank: int
    world: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def rank_from_env(env: Mapping[str, str]) -> Rank | None:
    """The torchrun rank of this process (RANK, WORLD_SIZE, LOCAL_RANK), None outside torchrun."""
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError:
        raise ValueError(
            f"torchrun environment: RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}"
        ) from None
    if not 0 <= rank < world:
        raise ValueError(f"torchrun environment: rank {rank} outside world size {world}")
    return Rank(rank, world, local)


def torchrun_args(tp: int, args: Sequence[str]) -> list[str]:
    """torchrun's arguments to run ``cloud-verifier`` ``args`` as ``tp`` ranks on this machine
    (``torchrun`` + these is the documented command line)."""
    return ["--standalone", f"--nproc-per-node={tp}", "-m", "cloud_verifier.daemon.cli", *args]


def launch_ranks(tp: int, args: Sequence[str]) -> int:
    """Run ``cloud-verifier`` ``args`` as ``tp`` ranks, this process being torchrun's agent
    (``cloud-verifier serve --tp N``). Returns the exit status: 0 after SIGTERM/SIGINT once every
    rank has stopped (torchrun forwards the signal: rank 0 drains and stops the followers), 1
    when a rank failed (torchrun then stopped the others)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    argv = torchrun_args(tp, args)
    log.info("tensor parallelism over %d ranks: torchrun %s", tp, " ".join(argv))
    # systemd's watchdog names this process (WATCHDOG_PID), but rank 0, a child, is the one
    # that pings (the unit needs NotifyAccess=all): hand the watchdog down to the ranks.
    os.environ.pop("WATCHDOG_PID", None)
    try:
        torchrun(argv)
    except SignalException as e:
        log.info("%s: every rank stopped", signal.Signals(e.sigval).name)
        return 0
    except ChildFailedError as e:
        log.error("a rank failed, the others were stopped: %s", e)
        return 1
    return 0


# ---------------------------------------------------------------------------- the wire


def encode_rows(rows: Sequence[Row]) -> torch.Tensor:
    """int64 ``[n, (start, keep, len(ids), len(pages), *ids, *pages) per row]``."""
    out: list[int] = [len(rows)]
    for r in rows:
        out += [r.start, r.keep, len(r.ids), len(r.slot.pages), *r.ids, *r.slot.pages]
    return torch.tensor(out, dtype=torch.int64)


def decode_rows(t: torch.Tensor) -> list[Row]:
    """The rows of :func:`encode_rows` (each its own SlotPages, holding the page list)."""
    v = t.tolist()
    n, i, rows = v[0], 1, []
    for _ in range(n):
        start, keep, m, p = v[i : i + 4]
        i += 4
        ids, pages = v[i : i + m], v[i + m : i + m + p]
        i += m + p
        rows.append(Row(SlotPages(list(pages), start + m), start, tuple(ids), keep))
    if i != len(v):
        raise ValueError(f"FORWARD payload of {len(v)} values, rows use {i}")
    return rows


class Channel:
    """Commands from rank 0 to every follower: a header broadcast ``[command, payload length]``,
    then the payload. Both on a gloo group (CPU tensors)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, cmd: Command, payload: torch.Tensor | None = None) -> None:
        n = 0 if payload is None else int(payload.numel())
        dist.broadcast(torch.tensor([int(cmd), n], dtype=torch.int64), src=0, group=self.group)
        if payload is not None and n:
            dist.broadcast(payload.contiguous(), src=0, group=self.group)

    def receive(self) -> tuple[Command, torch.Tensor]:
        head = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(head, src=0, group=self.group)
        cmd, n = Command(int(head[0])), int(head[1])
        payload = torch.zeros(n, dtype=torch.int64)
        if n:
            dist.broadcast(payload, src=0, group=self.group)
        return cmd, payload


def init_group(rank: Rank, timeout_s: float = DEFAULT_TIMEOUT_S) -> Channel:
    """Join the process group (NCCL with CUDA, else gloo) and open the command channel. A
    collective that waits ``timeout_s`` fails (its rank then exits)."""
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(rank.local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return Channel(dist.new_group(backend="gloo", timeout=timeout))


def meet(channel: Channel) -> None:
    """Every rank has loaded its shards (the barrier that makes rank 0 ready)."""
    dist.barrier(group=channel.group)


# ---------------------------------------------------------------------------- the two roles


class ShardedTarget:
    """Rank 0's target: each command goes to the followers, then runs here (the engine's thread
    is the only caller, so every rank sees the same commands in the same order)."""

    def __init__(
        self, inner: Any, channel: Channel, world: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.inner = inner
        #: The engine calls :meth:`heartbeat` after this long without work.
        self.idle_tick_s = timeout_s / 4
        self.channel = channel
        self.world = world
        self.fingerprint: Fingerprint = inner.fingerprint
        self.vocab_size: int = inner.vocab_size
        self.max_length: int | None = inner.max_length
        self.device: torch.device = inner.device
        self.compiled: bool = bool(getattr(inner, "compiled", False))
        self.description = f"{inner.description}, tensor-parallel over {world} ranks"
        self.closed = False

    def allocate(self, num_pages: int, page_size: int) -> PagedKV:
        self.channel.send(Command.ALLOCATE, torch.tensor([num_pages, page_size]))
        pool: PagedKV = self.inner.allocate(num_pages, page_size)
        return pool

    def kv_bytes_per_token(self) -> int:
        """This rank's KV bytes per token (every rank holds as much, of its own heads)."""
        return int(self.inner.kv_bytes_per_token())

    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        self.channel.send(Command.FORWARD, encode_rows(rows))
        logits: torch.Tensor = self.inner.forward(rows)
        return logits

    def heartbeat(self) -> None:
        """Idle: tell the followers rank 0 is alive (their wait for a command has a deadline)."""
        if not self.closed:
            self.channel.send(Command.HEARTBEAT)

    def close(self) -> None:
        """Shutdown: every follower leaves its loop and exits."""
        if not self.closed:
            self.closed = True
            self.channel.send(Command.STOP)


def follow(target: Any, channel: Channel) -> int:
    """A follower's life after loading: run rank 0's commands until STOP. Returns the number of
    forwards run. Any failure propagates (the process exits, torchrun ends the group)."""
    forwards = 0
    while True:
        cmd, payload = channel.receive()
        if cmd == Command.ALLOCATE:
            pages, size = payload.tolist()
            target.allocate(int(pages), int(size))
        elif cmd == Command.FORWARD:
            target.forward(decode_rows(payload))
            forwards += 1
        elif cmd == Command.STOP:
            return forwards
        # HEARTBEAT: nothing to do


def run_follower(rank: Rank, load: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """A follower process: ignore SIGTERM/SIGINT (torchrun forwards them to every rank; rank 0
    drains and then sends STOP, and the forwards of the drain still need this rank), join the
    group, load the shards (``load()`` → a target), meet the others and follow. Exit status."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = init_group(rank, timeout_s)
    target = load()
    meet(channel)
    log.info("rank %d of %d: following rank 0", rank.rank, rank.world)
    forwards = follow(target, channel)
    log.info("rank %d: stopped after %d forwards", rank.rank, forwards)
    dist.destroy_process_group()
    return 0


__all__ = [
    "Channel",
    "Command",
    "Rank",
    "ShardedTarget",
    "decode_rows",
    "encode_rows",
    "follow",
    "init_group",
    "launch_ranks",
    "meet",
    "rank_from_env",
    "run_follower",
    "torchrun_args",
]
