"""The pieces the wire schema is written with: field kinds, fields, tables.

A *kind* is the type of one wire value: how it is checked, converted and written (integer or float
with its range, string with its length limit, bool, enum, id/probability/sparse blob, nested map).
A :class:`Field` is one map entry (key, the name errors give, kind, presence, the dataclass
attribute it carries); a :class:`Table` is one msgpack map in wire order and the dataclass it
makes, a :class:`Frame` the table of a message. :mod:`shared.wire.schema` writes the tables;
:mod:`shared.wire.codec` runs them.

Checks run in a fixed order (unknown keys, then each field in wire order, then the cross-field
checks of the table's ``make``), so a frame with several faults names the first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from enum import Enum
from operator import attrgetter
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from shared.enums import TextEnum
from shared.maths.compression import IdArray, ProbArray, SparseDist
from shared.maths.sampling import MIN_TEMPERATURE
from shared.wire.messages import LOGPROB_FLOOR, PROTOCOL_VERSION, MsgType
from shared.wire.packing import (
    ProtocolError,
    WireContext,
    coarse_bytes,
    pack_coarse,
    pack_ids,
    pack_probs,
    unpack_coarse,
    unpack_ids,
    unpack_probs,
    unpack_sparse,
)

#: The key of a frame's header (``version << 4 | type``), first in every frame.
K_VT: Final = 0


def _bin(v: Any, name: str) -> bytes:
    if not isinstance(v, bytes):
        raise ProtocolError(name, f"expected binary, got {type(v).__name__}")
    return v


class Kind:
    """The type of one wire value.

    ``read`` checks a decoded msgpack value and returns the attribute's value, or raises
    :class:`ProtocolError` naming ``name``; ``write`` is its inverse (a kind that does not override
    it puts the attribute's value on the wire as it is). ``empty`` tells the value an optional
    field leaves out. Kinds of hot frames use the session context: encode() and decode() guarantee
    them one.
    """

    def read(self, v: Any, name: str, ctx: WireContext | None) -> Any:
        raise NotImplementedError

    def write(self, v: Any, ctx: WireContext | None) -> Any:
        return v

    def empty(self, v: Any) -> bool:
        return v is None


class Int(Kind):
    """An integer in [lo, hi]; ``hi`` may be a function of the session (max_gamma, |V| − 1)."""

    def __init__(self, lo: int, hi: int | Callable[[WireContext], int]) -> None:
        self.lo = lo
        self.hi = hi if isinstance(hi, int) else 0
        self.hi_of: Callable[[WireContext], int] | None = None if isinstance(hi, int) else hi

    def read(self, v: Any, name: str, ctx: WireContext | None) -> int:
        # bool is an int subclass in Python; refuse it so True does not pass as 1.
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(name, f"expected an integer, got {type(v).__name__}")
        hi = self.hi
        if self.hi_of is not None:
            assert ctx is not None
            hi = self.hi_of(ctx)
        if not self.lo <= v <= hi:
            raise ProtocolError(name, f"{v} outside [{self.lo}, {hi}]")
        return v


class Float(Kind):
    """A finite number in [lo, hi]; an integer is accepted (as a float), a bool is not."""

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def read(self, v: Any, name: str, ctx: WireContext | None) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ProtocolError(name, f"expected a number, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f) or not self.lo <= f <= self.hi:
            raise ProtocolError(name, f"{v} outside [{self.lo}, {self.hi}]")
        return f


class Temperature(Float):
    """A temperature: 0 (greedy) or in [MIN_TEMPERATURE, 100] (SamplingParams's own rule)."""

    def __init__(self) -> None:
        super().__init__(0.0, 100.0)

    def read(self, v: Any, name: str, ctx: WireContext | None) -> float:
        f = super().read(v, name, ctx)
        if 0.0 < f < MIN_TEMPERATURE:
            raise ProtocolError(name, f"{v} is neither 0 (greedy) nor >= {MIN_TEMPERATURE:g}")
        return f


class Str(Kind):
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def read(self, v: Any, name: str, ctx: WireContext | None) -> str:
        if not isinstance(v, str):
            raise ProtocolError(name, f"expected a string, got {type(v).__name__}")
        if len(v) > self.max_len:
            raise ProtocolError(name, f"longer than {self.max_len} characters")
        return v


class Bool(Kind):
    def read(self, v: Any, name: str, ctx: WireContext | None) -> bool:
        if not isinstance(v, bool):
            raise ProtocolError(name, f"expected a boolean, got {type(v).__name__}")
        return v


class Choice(Str):
    """A member of a TextEnum, on the wire as its value."""

    def __init__(self, enum: type[TextEnum]) -> None:
        super().__init__(256)
        self.enum, self.choices = enum, enum.choices()

    def read(self, v: Any, name: str, ctx: WireContext | None) -> TextEnum:
        s = super().read(v, name, ctx)
        if s not in self.choices:
            raise ProtocolError(name, f"{s!r} is not one of {', '.join(self.choices)}")
        return self.enum(s)

    def write(self, v: Any, ctx: WireContext | None) -> str:
        return str(self.enum(v).value)


class Flag(Kind):
    """A bool carried as a bit of a small integer (the only bit defined; off: left out)."""

    def __init__(self, bit: int) -> None:
        self.bit, self.range = bit, Int(0, bit)

    def read(self, v: Any, name: str, ctx: WireContext | None) -> bool:
        return bool(self.range.read(v, name, ctx) & self.bit)

    def write(self, v: Any, ctx: WireContext | None) -> int:
        return self.bit if v else 0

    def empty(self, v: Any) -> bool:
        return not v


class Ids(Kind):
    """Token ids below |V|, ``id_width`` bytes each; at most ``limit`` of them when set."""

    def __init__(self, limit: Callable[[WireContext], int] | None = None) -> None:
        self.limit = limit

    def read(self, v: Any, name: str, ctx: WireContext | None) -> IdArray:
        assert ctx is not None
        ids = unpack_ids(_bin(v, name), ctx.width, ctx.vocab_size, name)
        if self.limit is not None and len(ids) > self.limit(ctx):
            raise ProtocolError(name, f"{len(ids)} tokens exceed the limit {self.limit(ctx)}")
        return ids

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        return pack_ids(v, ctx.width)

    def empty(self, v: Any) -> bool:
        return len(v) == 0


class Probs(Kind):
    """float32 probabilities in (0, 1], or in [0, 1] with ``allow_zero``."""

    def __init__(self, *, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def read(self, v: Any, name: str, ctx: WireContext | None) -> ProbArray:
        return unpack_probs(_bin(v, name), name, allow_zero=self.allow_zero)

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        return pack_probs(v)


class Sparse(Kind):
    """A :class:`SparseDist`: K ids, then K float32 probabilities (see :func:`unpack_sparse`)."""

    def __init__(self, *, distributional: bool) -> None:
        self.distributional = distributional

    def read(self, v: Any, name: str, ctx: WireContext | None) -> SparseDist:
        assert ctx is not None
        return unpack_sparse(_bin(v, name), ctx, name, distributional=self.distributional)

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        return pack_ids(v.ids, ctx.width) + pack_probs(v.probs)


class Draft(Kind):
    """Propose's (draft, q): γ ids, then γ float32 q values unless the session is greedy-draft
    (``draft_probs`` off: q is all ones and not sent). γ, the blob length over the bytes per
    token, is in [``min_gamma``, max_gamma]: a Propose may carry no draft (a credit of a
    cloud-only edge, or fixed tokens alone), a Hedge may not."""

    def __init__(self, min_gamma: int = 1) -> None:
        self.min_gamma = min_gamma

    def read(self, v: Any, name: str, ctx: WireContext | None) -> tuple[IdArray, ProbArray]:
        assert ctx is not None
        blob, w = _bin(v, name), ctx.width
        gamma = _gamma_of(len(blob), w, ctx, name)
        if not self.min_gamma <= gamma <= ctx.max_gamma:
            raise ProtocolError(name, f"γ = {gamma} outside [{self.min_gamma}, {ctx.max_gamma}]")
        draft = unpack_ids(blob[: gamma * w], w, ctx.vocab_size, name + ".ids")
        if not ctx.draft_probs:
            return draft, np.ones(gamma, np.float32)
        if ctx.coarse_q:
            return draft, unpack_coarse(blob[gamma * w :], gamma, name + ".q")
        return draft, unpack_probs(blob[gamma * w :], name + ".q")

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        draft, q = v
        blob = pack_ids(draft, ctx.width)
        if not ctx.draft_probs:
            return blob
        return blob + (pack_coarse(q) if ctx.coarse_q else pack_probs(q))


def _gamma_of(size: int, w: int, ctx: WireContext, name: str) -> int:
    """γ of a (draft, q) blob of ``size`` bytes: γ ids of ``w`` bytes, then γ q values of 4
    bytes, of four bits (coarse) or none (greedy-draft)."""
    if ctx.draft_probs and ctx.coarse_q:
        gamma = 2 * size // (2 * w + 1)
        if gamma * w + coarse_bytes(gamma) != size:
            raise ProtocolError(name, f"length {size} fits no γ of {w}-byte ids and 4-bit q")
        return gamma
    per = w + (4 if ctx.draft_probs else 0)
    if size % per:
        raise ProtocolError(name, f"length {size} is not a multiple of {per}")
    return size // per


class Scored(Kind):
    """(ids, log-probabilities): n token ids, then n float32 values, finite and in
    [LOGPROB_FLOOR, 0]; at most ``limit`` entries when set."""

    def __init__(self, limit: Callable[[WireContext], int] | None = None) -> None:
        self.limit = limit

    def read(
        self, v: Any, name: str, ctx: WireContext | None
    ) -> tuple[IdArray, npt.NDArray[np.float32]]:
        assert ctx is not None
        blob, w = _bin(v, name), ctx.width
        if len(blob) % (w + 4):
            raise ProtocolError(name, f"length {len(blob)} is not a multiple of {w + 4}")
        n = len(blob) // (w + 4)
        if self.limit is not None and n > self.limit(ctx):
            raise ProtocolError(name, f"{n} entries exceed the limit {self.limit(ctx)}")
        ids = unpack_ids(blob[: n * w], w, ctx.vocab_size, name + ".ids")
        lp = np.frombuffer(blob[n * w :], "<f4").astype(np.float32)
        if not np.all(np.isfinite(lp) & (lp >= LOGPROB_FLOOR) & (lp <= 0.0)):
            raise ProtocolError(
                name + ".lp", f"values must be finite and in [{LOGPROB_FLOOR:g}, 0]"
            )
        return ids, lp

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        ids, lp = v
        if len(ids) != len(lp):
            raise ValueError(f"{len(lp)} log-probabilities for {len(ids)} ids")
        return pack_ids(ids, ctx.width) + pack_probs(lp)

    def empty(self, v: Any) -> bool:
        return len(v[0]) == 0


class TopKSizes(Kind):
    """The sizes K_0..K_γ of FederatedReply's distributions: 2..max_gamma+1 uint32 values, each at
    most min(max_k, |V|)."""

    def read(self, v: Any, name: str, ctx: WireContext | None) -> IdArray:
        assert ctx is not None
        raw = _bin(v, name)
        if len(raw) % 4 or not 2 <= len(raw) // 4 <= ctx.max_gamma + 1:
            raise ProtocolError(name, f"needs 2..{ctx.max_gamma + 1} uint32 entries")
        ks = np.frombuffer(raw, "<u4").astype(np.int64)
        if np.any(ks > ctx.max_k) or np.any(ks > ctx.vocab_size):
            limit = min(ctx.max_k, ctx.vocab_size)
            raise ProtocolError(name, f"a top-k size exceeds the limit {limit}")
        return ks

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        return np.array(v, "<u4").tobytes()


class Distances(Kind):
    """float32 L1 distances between distributions, ‖p̂ − p‖₁: finite, in [0, 2] (the message checks
    how many)."""

    def read(self, v: Any, name: str, ctx: WireContext | None) -> npt.NDArray[np.float32]:
        buf = _bin(v, name)
        if len(buf) % 4:
            raise ProtocolError(name, f"length {len(buf)} is not a multiple of 4")
        d = np.frombuffer(buf, "<f4").astype(np.float32)
        if not np.all(np.isfinite(d) & (d >= 0) & (d <= 2.0 + 1e-4)):
            raise ProtocolError(name, "values must be finite and in [0, 2]")
        return d

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        return pack_probs(v)


class Map(Kind):
    """A nested map with a table of its own (Fingerprint, SamplingParams)."""

    def __init__(self, table: Table) -> None:
        self.table = table

    def read(self, v: Any, name: str, ctx: WireContext | None) -> Any:
        if not isinstance(v, dict):
            raise ProtocolError(name, "expected a map")
        return self.table.read(v, ctx)

    def write(self, v: Any, ctx: WireContext | None) -> dict[Any, Any]:
        return self.table.write(v, ctx)


class Presence(Enum):
    """Whether a field must be on the wire.

    * REQUIRED: always written; a frame without it is refused ("missing").
    * OPTIONAL: left out when its value is empty (None, no ids, a flag off); absent or nil, it reads
      back as the attribute's dataclass default, which is that empty value.
    * DEFAULTED: always written; absent, it reads as the attribute's dataclass default (nil is read,
      and refused).
    """

    REQUIRED = "required"
    OPTIONAL = "optional"
    DEFAULTED = "defaulted"


#: What m.get() returns for a key that is not in the map (None is msgpack nil).
_ABSENT: Final = object()


@dataclass(frozen=True)
class Field:
    """One map entry: its ``key``, the ``name`` errors give, its ``kind``, its presence, and the
    dataclass attribute it carries (``attr``, by default ``name``; a tuple when the kind reads and
    writes a tuple of attributes). ``get`` instead derives the wire value from the whole object,
    for a field that carries only part of an attribute (the table's ``make`` reassembles it)."""

    key: int | str
    name: str
    kind: Kind
    attr: str | tuple[str, ...] = ""
    presence: Presence = Presence.REQUIRED
    get: Callable[[Any], Any] | None = None


class Table:
    """The fields of one msgpack map in wire order, and the dataclass they make.

    Invariants, checked here (at import): keys are unique; the fields' attributes cover the
    dataclass's fields in order, so that ``cls(*values)`` makes it unless the table has a
    ``make`` (which must then also run the cross-field checks); a non-required field's attribute
    has a dataclass default, and an optional field's default is its kind's empty value. ``vt``, the
    header of a frame, goes first under key 0.
    """

    def __init__(
        self,
        cls: type[Any],
        scope: str,
        fields: list[Field],
        *,
        vt: int | None = None,
        make: Callable[[list[Any]], Any] | None = None,
        prefix: str = "",
    ) -> None:
        self.cls, self.scope, self.vt, self.fields = cls, scope, vt, tuple(fields)
        keys = [f.key for f in fields] + ([] if vt is None else [K_VT])
        if len(set(keys)) != len(keys):
            raise TypeError(f"{scope}: duplicate keys")
        self.keys = frozenset(keys)
        attrs = [f.attr or f.name for f in fields]
        flat = [a for at in attrs for a in ((at,) if isinstance(at, str) else at)]
        members = {m.name: m for m in dataclasses.fields(cls)}
        if list(dict.fromkeys(flat)) != list(members):
            raise TypeError(f"{scope}: the fields do not cover {cls.__name__}'s attributes")
        if make is None and (flat != list(members) or len(flat) != len(attrs)):
            raise TypeError(f"{scope}: this table needs a make() to build {cls.__name__}")
        self.make: Callable[[list[Any]], Any] = make or (lambda values: cls(*values))
        # Per field, so that a frame costs one pass and no lookups: for reading (key, name in
        # errors, reader, maker of the absent value or None when required, whether nil is absent);
        # for writing (key, getter, writer or None for as-is, emptiness test or None to always).
        readers, writers = [], []
        for f, at in zip(fields, attrs, strict=True):
            absent = None
            if f.presence is not Presence.REQUIRED:
                if isinstance(at, str):
                    absent = _default_of(members[at])
                else:  # several attributes in one field: a tuple of their defaults
                    parts = [_default_of(members[a]) for a in at]

                    def absent(parts: list[Callable[[], Any]] = parts) -> tuple[Any, ...]:
                        return tuple(p() for p in parts)

                if f.presence is Presence.OPTIONAL and not f.kind.empty(absent()):
                    raise TypeError(f"{scope}: {f.name}'s default is not its empty value")
            readers.append(
                (f.key, prefix + f.name, f.kind.read, absent, f.presence is Presence.OPTIONAL)
            )
            get = f.get or (attrgetter(at) if isinstance(at, str) else attrgetter(*at))
            put = None if type(f.kind).write is Kind.write else f.kind.write
            writers.append(
                (f.key, get, put, f.kind.empty if f.presence is Presence.OPTIONAL else None)
            )
        self.readers = tuple(readers)
        self.writers = tuple(writers)

    def read(self, m: dict[Any, Any], ctx: WireContext | None) -> Any:
        """Check ``m`` (unknown keys first, then each field in wire order) and make the object."""
        if not m.keys() <= self.keys:
            extra = sorted(map(str, set(m) - self.keys))
            raise ProtocolError(self.scope, f"unknown field(s) {extra}")
        values = []
        for key, name, read, absent, nil_is_absent in self.readers:
            v = m.get(key, _ABSENT)
            if v is _ABSENT or (v is None and nil_is_absent):
                if absent is None:
                    raise ProtocolError(name, "missing")
                values.append(absent())
            else:
                values.append(read(v, name, ctx))
        return self.make(values)

    def write(self, obj: Any, ctx: WireContext | None) -> dict[Any, Any]:
        m: dict[Any, Any] = {} if self.vt is None else {K_VT: self.vt}
        for key, get, put, empty in self.writers:
            v = get(obj)
            if empty is None or not empty(v):
                m[key] = v if put is None else put(v, ctx)
        return m


class Frame(Table):
    """A message's table. Hot frames (all but Hello, Welcome and Error) need a WireContext."""

    def __init__(
        self,
        msg_type: MsgType,
        cls: type[Any],
        fields: list[Field],
        make: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        vt = (PROTOCOL_VERSION << 4) | int(msg_type)
        super().__init__(cls, msg_type.name.lower(), fields, vt=vt, make=make)
        self.msg_type = msg_type
        # Hot frames need the session's context; these do not, and may come before it (a
        # Progress frame while the session waits in the verifier's admission line).
        self.hot = msg_type not in (
            MsgType.HELLO,
            MsgType.WELCOME,
            MsgType.ERROR,
            MsgType.PROGRESS,
        )


def _default_of(f: dataclasses.Field[Any]) -> Callable[[], Any]:
    if f.default_factory is not MISSING:
        return f.default_factory
    if f.default is MISSING:
        raise TypeError(f"{f.name} has no default, so it must be required")
    value = f.default
    return lambda: value
