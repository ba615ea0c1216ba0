"""The view served over HTTP by uvicorn, inside the anyio event loop already running (a
run's own): on loopback unless told otherwise, and off it only with a key."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable

import uvicorn

from libra._uvicorn import ListeningServer, running
from libra.config import UsageError
from libra.view._app import ViewApp
from libra.view._history import History

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def view_key(host: str, key: str | None) -> str | None:
    """The key a view on ``host`` needs: none on loopback unless given; off loopback the
    one given (or a fresh one: a view off loopback is never open)."""
    if host in LOOPBACK:
        return key
    return key or secrets.token_urlsafe(18)


@contextlib.asynccontextmanager
async def serve_view(
    history: History,
    host: str = "127.0.0.1",
    port: int = 0,
    key: str | None = None,
    allows: Callable[[str], bool] | None = None,
) -> AsyncIterator[str]:
    """Serve the view of ``history`` while the block runs; its URL (with the key).
    ``allows`` accepts other keys too (the gateway's admin keys)."""
    if host not in LOOPBACK and not key and allows is None:
        raise UsageError(f"a view on {host} needs a key (the gateway's, or --view-key)")
    config = uvicorn.Config(
        ViewApp(history, key, allows),
        host=host,
        port=port,
        loop="none",
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    async with running(ListeningServer(config), "the view") as bound:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        yield f"http://{shown}:{bound}/" + (f"?key={key}" if key else "")
