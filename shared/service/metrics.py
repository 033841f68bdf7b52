"""A tiny Prometheus text exposition (format 0.0.4): counters, gauges, histograms with labels.

No dependencies, no asyncio, no I/O: a :class:`Registry` holds metrics (each registers itself in
the registry it is made for, as in ``prometheus_client``) and :meth:`Registry.render` returns the
text a ``/metrics`` endpoint serves. Updates take a per-metric lock, so a worker
thread may record into the same metrics as the event loop.

    reg = Registry()
    drafts = Counter(reg, "wanspec_spec_decode_num_drafts_total", "Draft batches verified.")
    per_pos = Counter(reg, "wanspec_x_total", "Per position.", labels=("position",))
    drafts.inc()
    per_pos.labels(position="0").inc()
    text = reg.render()
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_BUCKETS",
    "Counter",
    "Gauge",
    "Histogram",
    "HttpMetrics",
    "Registry",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: Seconds, from 0.5 ms to 30 s: round trips and forwards of small to large models.
DEFAULT_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LabelValues = tuple[str, ...]


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + inner + "}"


class _Metric:
    kind: str = ""

    def __init__(
        self, registry: Registry, name: str, help_text: str, labels: Sequence[str] = ()
    ) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labels:
            if not _LABEL_RE.match(label) or label.startswith("__") or label == "le":
                raise ValueError(f"invalid label name {label!r} for {name}")
        self.name = name
        self.help = help_text
        self.labelnames: tuple[str, ...] = tuple(labels)
        self._lock = threading.Lock()
        # Last: a scrape may render it from now on (subclasses set their data before).
        registry._register(self)

    def _key(self, labelvalues: dict[str, str]) -> LabelValues:
        if set(labelvalues) != set(self.labelnames):
            raise ValueError(
                f"{self.name} takes labels {self.labelnames}, got {tuple(sorted(labelvalues))}"
            )
        return tuple(str(labelvalues[n]) for n in self.labelnames)

    def _header(self) -> list[str]:
        return [
            f"# HELP {self.name} {self.help.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}",
            f"# TYPE {self.name} {self.kind}",
        ]

    def render(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError


class _Value(_Metric):
    """Counter and gauge: one float per label set."""

    def __init__(
        self, registry: Registry, name: str, help_text: str, labels: Sequence[str] = ()
    ) -> None:
        self._values: dict[LabelValues, float] = {} if labels else {(): 0.0}
        super().__init__(registry, name, help_text, labels)

    def _add(self, key: LabelValues, amount: float) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        lines = self._header()
        lines += [f"{self.name}{_label_text(self.labelnames, k)} {_fmt(v)}" for k, v in items]
        return lines


class Counter(_Value):
    """Monotone count. Name it ``..._total``."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc({amount}))")
        self._add(self._key(labels), amount)

    def follow(self, total: float, **labels: str) -> None:
        """Up to ``total``, a monotone count another object owns (read at scrape time); a total
        below the value already counted is left as it is: a counter never decreases."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = max(self._values.get(key, 0.0), total)

    def labels(self, **labels: str) -> _CounterChild:
        return _CounterChild(self, self._key(labels))


class _CounterChild:
    def __init__(self, parent: Counter, key: LabelValues) -> None:
        self._parent, self._key = parent, key

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self._parent.name}: a counter cannot decrease")
        self._parent._add(self._key, amount)


class Gauge(_Value):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._add(self._key(labels), amount)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._add(self._key(labels), -amount)


class Histogram(_Metric):
    """Cumulative buckets plus ``_sum`` and ``_count``, per label set."""

    kind = "histogram"

    def __init__(
        self,
        registry: Registry,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = DEFAULT_BUCKETS,
    ) -> None:
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if not bounds or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must be distinct and non-empty")
        self.bounds: tuple[float, ...] = (*bounds, math.inf)
        # per label set: [count per bucket (not cumulative)..., sum]
        self._data: dict[LabelValues, list[float]] = {}
        if not labels:
            self._data[()] = [0.0] * (len(self.bounds) + 1)
        super().__init__(registry, name, help_text, labels)

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        i = next(j for j, b in enumerate(self.bounds) if value <= b)
        with self._lock:
            row = self._data.setdefault(key, [0.0] * (len(self.bounds) + 1))
            row[i] += 1
            row[-1] += value

    def count(self, **labels: str) -> int:
        with self._lock:
            row = self._data.get(self._key(labels))
            return 0 if row is None else int(sum(row[:-1]))

    def sum(self, **labels: str) -> float:
        with self._lock:
            row = self._data.get(self._key(labels))
            return 0.0 if row is None else row[-1]

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        lines = self._header()
        names = (*self.labelnames, "le")
        for key, row in items:
            cum = 0.0
            for b, n in zip(self.bounds, row[:-1], strict=True):
                cum += n
                lines.append(f"{self.name}_bucket{_label_text(names, (*key, _fmt(b)))} {_fmt(cum)}")
            lt = _label_text(self.labelnames, key)
            lines.append(f"{self.name}_sum{lt} {_fmt(row[-1])}")
            lines.append(f"{self.name}_count{lt} {_fmt(cum)}")
        return lines


class Registry:
    """An ordered set of metrics with unique names."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _register(self, metric: _Metric) -> None:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric

    def names(self) -> list[str]:
        with self._lock:
            return list(self._metrics)

    def render(self) -> str:
        """The whole exposition, ending with a newline."""
        with self._lock:
            metrics = list(self._metrics.values())
        lines: list[str] = []
        for m in metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class HttpMetrics:
    """The metrics a service's HTTP connection guard
    (:class:`shared.service.http_guard.ConnectionGuard`) records into, declared alike for every
    service: named ``{prefix}http_*``, their help calling the guarded connections
    ``connections``."""

    http_pending: Gauge
    http_refused: Counter
    http_evicted: Counter
    header_timeouts: Counter

    @classmethod
    def declare(cls, registry: Registry, prefix: str, connections: str) -> HttpMetrics:
        """Registered in ``registry``; ``connections`` as it reads in the middle of a sentence
        ("connections", "API connections")."""
        each = connections[:1].upper() + connections[1:]
        return cls(
            http_pending=Gauge(
                registry,
                f"{prefix}http_pending_connections",
                f"{each} whose request headers are not complete yet (or idle in keep-alive).",
            ),
            http_refused=Counter(
                registry,
                f"{prefix}http_connections_refused_total",
                f"{each} refused at once (503) by reason (max_pending_connections, "
                "max_pending_per_address).",
                labels=("reason",),
            ),
            http_evicted=Counter(
                registry,
                f"{prefix}http_pending_evicted_total",
                f"Pending {connections} closed to admit a new one (max_pending_connections "
                "reached; the oldest, if it had waited long enough).",
            ),
            header_timeouts=Counter(
                registry,
                f"{prefix}http_header_timeouts_total",
                f"{each} closed because their request headers did not arrive within "
                "header_timeout.",
            ),
        )
