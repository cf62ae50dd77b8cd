"""The web dashboard: ``mutexcron dashboard``, or the same app in your own WSGI or ASGI application.

.. code-block:: python

    from mutexcron.dashboard import create_app

    dashboard = create_app("postgresql://cron@db/app", action_token=os.environ["MUTEXCRON_DASHBOARD_TOKEN"])
    # WSGI (Flask): app.wsgi_app = DispatcherMiddleware(app.wsgi_app, {"/mutexcron": dashboard})
    # ASGI (FastAPI, Starlette): app.mount("/mutexcron", dashboard.asgi)

Modules: :mod:`.app` (routes, the WSGI app), :mod:`.asgi` (the ASGI adapter), :mod:`.views`
(the pages, :data:`.views.PAGES`), :mod:`.charts` (inline SVG), :mod:`.reads` (the store's
reads, never a write), :mod:`.finished` (the ends the task stores keep, cancels apart), :mod:`.alarms`,
:mod:`.actions`, :mod:`.security` (token and CSRF), :mod:`.jobsfile`, :mod:`.server` (connection
cap, request deadline) and :mod:`.cli` (the command); ``static/`` the stylesheet and script.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Dashboard, create_app

__all__ = ["Dashboard", "create_app"]


def __getattr__(name: str) -> Any:  # imported on first use: `mutexcron --help` does not load the pages
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
