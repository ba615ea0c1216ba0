"""One ASGI app for a fleet of in-process emulated servers, routed by host name.

``http://NAME/...`` goes to instance NAME. Instances join and leave while calls run, as
in a live fleet: a call to an instance that is not there fails like a refused
connection, and removing an instance cuts the calls it is serving (they fail like a
reset connection, and the engine retries them elsewhere), as stopping a real server does.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import anyio

from libra.emulation._app import EmulatorApp

Scope = MutableMapping[str, Any]


class FleetApp:
    """One ASGI app for the whole fleet: ``http://NAME/...`` goes to instance NAME."""

    def __init__(self, apps: dict[str, EmulatorApp] | None = None) -> None:
        self.apps: dict[str, EmulatorApp] = dict(apps or {})
        self._calls: dict[str, set[anyio.CancelScope]] = {}

    def add(self, name: str, app: EmulatorApp) -> None:
        if name in self.apps:
            raise ValueError(f"instance {name!r} is in the fleet already")
        self.apps[name] = app

    def remove(self, name: str) -> EmulatorApp:
        """Take ``name`` out; the calls it is serving are cut."""
        app = self.apps.pop(name)
        for call in self._calls.pop(name, set()):
            call.cancel()
        return app

    def serving(self, name: str) -> int:
        """Calls ``name`` is answering now."""
        return len(self._calls.get(name, ()))

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        name = scope["server"][0]
        app = self.apps.get(name)
        if app is None:  # an instance that left the fleet: as unreachable as a real one
            raise ConnectionRefusedError(f"no instance {name!r} in the fleet")
        calls = self._calls.setdefault(name, set())
        with anyio.CancelScope() as call:
            calls.add(call)
            try:
                await app(scope, receive, send)
            finally:
                calls.discard(call)
        if call.cancelled_caught:  # removed mid-call: the server went away under it
            raise ConnectionResetError(f"instance {name!r} stopped during the call")
