"""mutexcron: run one APScheduler jobs file on many servers; each guarded job runs once per fire time."""

from __future__ import annotations

__version__ = "0.1.0"
