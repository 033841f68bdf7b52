"""Moved to :mod:`shared.sdnotify` (both services use it); kept as an alias."""

from shared.sdnotify import Notifier

__all__ = ["Notifier"]
