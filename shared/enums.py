"""A string-valued enum that prints as its value (Python 3.10 has no ``enum.StrEnum``).

Modes and states travel through settings files, CLI flags and JSON as plain strings; members
compare equal to their values, format as their values, and :meth:`TextEnum.parse` turns user input
into a member with an error that lists the choices.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound="TextEnum")


class TextEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        """Every member's value, in definition order."""
        return tuple(str(m.value) for m in cls)

    @classmethod
    def parse(cls: type[E], value: object, what: str | None = None) -> E:
        """``value`` as a member; ValueError naming ``what`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            name = what or cls.__name__
            raise ValueError(
                f"{name} must be one of {', '.join(cls.choices())}, got {value!r}"
            ) from None
