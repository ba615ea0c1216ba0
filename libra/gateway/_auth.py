"""Who may call ``libra serve``: API keys for the OpenAI surface, another for the admin API.

Clients send ``Authorization: Bearer KEY``. User keys come from ``LIBRA_API_KEY`` or a
key file (one key a line); admin keys, for ``/admin/*`` (pause, resume, weight reloads),
from ``LIBRA_ADMIN_KEY`` or their own file. Without admin keys the admin API is closed.
Authentication can be turned off only on a loopback address. Keys are kept as SHA-256
digests and compared in constant time (every key, every time); they never reach a log
or an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from libra.config import UsageError

_BEARER = b"bearer "

Verdict = Literal["ok", "missing", "invalid", "forbidden"]
"""``missing``/``invalid``: a 401; ``forbidden``: a valid user key on an admin route, 403."""


class AuthError(UsageError, ValueError):
    """The gateway's authentication settings cannot be used; the message says why."""


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class Keys:
    """The accepted keys, as digests; ``enabled`` False: every user request is let in."""

    users: tuple[bytes, ...]
    admins: tuple[bytes, ...]
    enabled: bool = True

    @classmethod
    def of(cls, users: Iterable[str], admins: Iterable[str], *, enabled: bool = True) -> Keys:
        return cls(
            tuple(_digest(k.encode()) for k in users),
            tuple(_digest(k.encode()) for k in admins),
            enabled,
        )

    def check(self, authorization: bytes | None, *, admin: bool) -> Verdict:
        """What a request with this ``Authorization`` header may do on a route."""
        if not self.enabled and not (admin and self.admins):
            return "ok"
        key = _bearer(authorization)
        if key is None:
            return "missing"
        digest = _digest(key)
        if admin:
            if _any_equal(digest, self.admins):
                return "ok"
            return "forbidden" if _any_equal(digest, self.users) else "invalid"
        return (
            "ok" if _any_equal(digest, self.users) or _any_equal(digest, self.admins) else "invalid"
        )


def _bearer(authorization: bytes | None) -> bytes | None:
    if authorization is None or authorization[:7].lower() != _BEARER:
        return None
    key = authorization[7:].strip()
    return key or None


def _any_equal(digest: bytes, digests: tuple[bytes, ...]) -> bool:
    """Whether ``digest`` is one of ``digests``, comparing with every one of them."""
    found = False
    for candidate in digests:
        found |= hmac.compare_digest(digest, candidate)
    return found


def read_keys(env_var: str, key_file: Path | None) -> list[str]:
    """The keys of ``$env_var`` and of ``key_file`` (one a line; ``#`` comments)."""
    keys: list[str] = []
    value = os.environ.get(env_var, "").strip()
    if value:
        keys.append(value)
    if key_file is not None:
        lines = key_file.read_text().splitlines()
        keys += [s for line in lines if (s := line.strip()) and not s.startswith("#")]
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def gateway_keys(
    host: str,
    *,
    no_auth: bool,
    api_key_file: Path | None = None,
    admin_key_file: Path | None = None,
) -> Keys:
    """The keys ``libra serve`` checks, from the environment and the key files.

    Refuses ``no_auth`` off loopback, and a server with auth on but no user key."""
    admins = read_keys("LIBRA_ADMIN_KEY", admin_key_file)
    if no_auth:
        if not is_loopback(host):
            raise AuthError(
                f"--no-auth is allowed only on a loopback address, not {host!r}: "
                "set LIBRA_API_KEY or --api-key-file to serve on the network"
            )
        return Keys.of([], admins, enabled=False)
    users = read_keys("LIBRA_API_KEY", api_key_file)
    if not users:
        raise AuthError(
            "no API key: set LIBRA_API_KEY or pass --api-key-file "
            "(or --no-auth, on a loopback address only)"
        )
    return Keys.of(users, admins)
