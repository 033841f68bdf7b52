"""Acceptance traces: per prompt, the target's greedy path and the draft's top tokens along it
(recorded by :mod:`bench.studies.traces`, read by the simulation, :mod:`bench.lib.sim`).

Under greedy decoding these determine which drafted tokens a verifier accepts: a token drafted
at position j from an on-path context is accepted iff it equals ``path[j]``.

File (gzip of JSON, deterministic bytes for the same content)::

    {"provenance": {...}, "target": str, "draft": str, "length": int, "top_k": int,
     "traces": [{"name", "dataset", "split", "prompt", "path", "eos", "draft_top",
                 "draft_top_p"}, ...]}
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.lib.prompts import Split


@dataclass(frozen=True)
class Trace:
    """One prompt's trace. Invariants: ``len(draft_top) == len(draft_top_p) == len(path)``;
    ``draft_top[j]`` (probabilities ``draft_top_p[j]``, descending) is the draft's top-k at
    context ``prompt + path[:j]``, its argmax first; ``eos`` iff ``path`` ends at an EOS id."""

    name: str
    dataset: str
    split: Split
    prompt: tuple[int, ...]
    path: tuple[int, ...]
    eos: bool
    draft_top: tuple[tuple[int, ...], ...]
    draft_top_p: tuple[tuple[float, ...], ...]

    def draft_ok(self, j: int) -> bool:
        """Whether the draft's greedy token at position ``j`` is the target's."""
        return self.draft_top[j][0] == self.path[j]

    def rank(self, j: int) -> int | None:
        """The index of ``path[j]`` in the draft's top-k at ``j``; None if it is not there."""
        try:
            return self.draft_top[j].index(self.path[j])
        except ValueError:
            return None

    def agreement(self) -> float:
        """The fraction of path positions where the draft's greedy token is the target's."""
        if not self.path:
            return 0.0
        return sum(self.draft_ok(j) for j in range(len(self.path))) / len(self.path)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dataset": self.dataset,
            "split": self.split.value,
            "prompt": list(self.prompt),
            "path": list(self.path),
            "eos": self.eos,
            "draft_top": [list(r) for r in self.draft_top],
            "draft_top_p": [list(r) for r in self.draft_top_p],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Trace:
        trace = cls(
            name=str(doc["name"]),
            dataset=str(doc["dataset"]),
            split=Split(doc["split"]),
            prompt=tuple(int(t) for t in doc["prompt"]),
            path=tuple(int(t) for t in doc["path"]),
            eos=bool(doc["eos"]),
            draft_top=tuple(tuple(int(t) for t in r) for r in doc["draft_top"]),
            draft_top_p=tuple(tuple(float(p) for p in r) for r in doc["draft_top_p"]),
        )
        if not len(trace.draft_top) == len(trace.draft_top_p) == len(trace.path):
            raise ValueError(f"trace {trace.name}: draft_top/draft_top_p do not match the path")
        return trace


@dataclass(frozen=True)
class TraceSet:
    """A trace file's content."""

    target: str
    draft: str
    length: int
    top_k: int
    provenance: dict[str, Any]
    traces: tuple[Trace, ...]

    def split(self, split: Split) -> list[Trace]:
        return [t for t in self.traces if t.split == split]

    def measured(self) -> list[Trace]:
        return self.split(Split.MEASURED)

    def tuning(self) -> list[Trace]:
        return self.split(Split.TUNING)

    def by_name(self, name: str) -> Trace:
        """The trace of prompt ``name`` (``gsm8k/3``); KeyError if there is none."""
        for t in self.traces:
            if t.name == name:
                return t
        raise KeyError(f"no trace named {name!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "provenance": self.provenance,
            "target": self.target,
            "draft": self.draft,
            "length": self.length,
            "top_k": self.top_k,
            "traces": [t.to_json() for t in self.traces],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TraceSet:
        return cls(
            target=str(doc["target"]),
            draft=str(doc["draft"]),
            length=int(doc["length"]),
            top_k=int(doc["top_k"]),
            provenance=dict(doc["provenance"]),
            traces=tuple(Trace.from_json(t) for t in doc["traces"]),
        )


def load_traces(path: Path | str) -> TraceSet:
    """Read a trace file written by :func:`save_traces`."""
    return TraceSet.from_json(orjson.loads(gzip.decompress(Path(path).read_bytes())))


def save_traces(path: Path | str, traces: TraceSet) -> None:
    """Write ``traces`` as gzip'd JSON; the same content gives the same bytes."""
    data = gzip.compress(orjson.dumps(traces.to_json()), mtime=0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)
