"""Import a user's jobs file: :func:`mutexcron.jobsfile.load_scheduler`, under the name the commands use."""

from __future__ import annotations

from ..jobsfile import load_scheduler

__all__ = ["load_scheduler"]
