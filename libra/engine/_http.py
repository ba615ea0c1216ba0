"""The engine's HTTP layer: a two-method protocol and the transports behind it.

The engine only ever POSTs a JSON body and reads the answer's bytes (and GETs a few
small documents), so that is the whole protocol. Its implementations
(``_transports.py`` picks one by name):

- :class:`~libra.engine._httptools.HttptoolsTransport` for real ports, the default: the
  least CPU a call of the clients measured here (``_httptools.py``).
- :class:`AiohttpTransport` for real ports too. On these machines httpx's own transport
  managed ~900 requests/s at 16 concurrent and timed out at 512 (measured with one
  local uvicorn server on 2 cores), and httpx on top of aiohttp still spent about a
  third of the engine's time building httpx models. ``libra bench engine`` prints the
  engine beside bare aiohttp, httpx and httptools clients.
- :class:`HttpxTransport` for anything httpx can reach, notably an in-process fleet
  through ``httpx.ASGITransport``, which also runs under trio and a virtual clock
  (``_asgi.py`` has a cheaper one for the emulated fleet).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import TracebackType
from typing import Protocol, Self

import aiohttp
import anyio
import httpx


class TransportError(Exception):
    """The server could not be reached, or the connection broke or timed out."""


class TransportTimeout(TransportError):
    """No answer within the request's ``timeout_s``."""

    @classmethod
    def after(cls, timeout_s: float) -> TransportTimeout:
        return cls(f"no answer within {timeout_s:.1f} s")


class HTTPTransport(Protocol):
    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        """POST ``body``; the answer's status and body. Raises :class:`TransportError`,
        :class:`TransportTimeout` when no answer came within ``timeout_s`` (the engine's
        per-call timeouts rely on it: the transport's own timer, not a scope per call)."""
        ...

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class BaseTransport(ABC):
    """What transports share: ``post``/``get`` over one ``_request``, and the context
    manager; an implementation writes ``_request`` and ``aclose``."""

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        return await self._request("POST", url, body, headers, timeout_s)

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        return await self._request("GET", url, None, {}, timeout_s)

    @abstractmethod
    async def _request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> tuple[int, bytes]: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class AiohttpTransport(BaseTransport):
    """``max_connections`` bounds the sockets to all servers together; callers beyond it
    wait for a free connection instead of overrunning the servers' accept backlogs."""

    def __init__(self, max_connections: int = 1024) -> None:
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:  # created lazily: a session binds to the running loop
            connector = aiohttp.TCPConnector(limit=self.max_connections, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> tuple[int, bytes]:
        try:
            async with self._open().request(
                method, url, data=body, headers=headers, timeout=self._timeout(timeout_s)
            ) as response:
                return response.status, await response.read()
        except TimeoutError as exc:  # aiohttp's timer: every request arms one anyway
            raise TransportTimeout.after(timeout_s) from exc
        except aiohttp.ClientError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    def _timeout(self, timeout_s: float) -> aiohttp.ClientTimeout:
        """One timeout object per value (most calls share a few), not one per request."""
        timeout = self._timeouts.get(timeout_s)
        if timeout is None:
            if len(self._timeouts) >= 64:  # deadlines make many odd values: keep it small
                self._timeouts.clear()
            timeout = self._timeouts[timeout_s] = aiohttp.ClientTimeout(total=timeout_s)
        return timeout

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class HttpxTransport(BaseTransport):
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def _request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> tuple[int, bytes]:
        try:  # anyio's clock too: an in-process fleet's transport has no timer of its own
            with anyio.fail_after(timeout_s):
                response = await self.client.request(
                    method, url, content=body, headers=headers, timeout=timeout_s
                )
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise TransportTimeout.after(timeout_s) from exc
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self.client.aclose()
