"""API keys: bearer tokens checked against digests, admin keys apart, no auth only on
loopback, keys from the environment and from files."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.gateway._auth import AuthError, Keys, gateway_keys, is_loopback, read_keys


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_user_and_admin_keys_each_open_their_routes() -> None:
    keys = Keys.of(["u1", "u2"], ["a1"])
    assert keys.check(bearer("u2"), admin=False) == "ok"
    assert keys.check(bearer("a1"), admin=False) == "ok"  # an admin may chat too
    assert keys.check(bearer("a1"), admin=True) == "ok"
    assert keys.check(bearer("u1"), admin=True) == "forbidden"
    assert keys.check(bearer("nope"), admin=False) == "invalid"
    assert keys.check(None, admin=False) == "missing"
    assert keys.check(b"Basic dTE=", admin=False) == "missing"
    assert keys.check(b"bearer u1", admin=False) == "ok"  # the scheme is case-insensitive
    assert b"u1" not in repr(keys).encode()  # only digests are kept


def test_auth_off_opens_user_routes_but_admin_keys_still_guard_the_admin_api() -> None:
    keys = Keys.of([], ["a1"], enabled=False)
    assert keys.check(None, admin=False) == "ok"
    assert keys.check(None, admin=True) == "missing"
    assert Keys.of([], [], enabled=False).check(None, admin=True) == "ok"


def test_no_auth_is_refused_off_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIBRA_API_KEY", raising=False)
    assert not gateway_keys("127.0.0.1", no_auth=True).enabled
    assert not gateway_keys("::1", no_auth=True).enabled
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(AuthError, match="only on a loopback"):
            gateway_keys(host, no_auth=True)
    with pytest.raises(AuthError, match="LIBRA_API_KEY"):
        gateway_keys("127.0.0.1", no_auth=False)
    assert is_loopback("localhost") and is_loopback("127.0.0.2")


def test_keys_come_from_the_environment_and_key_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    users, admins = tmp_path / "users", tmp_path / "admins"
    users.write_text("# team keys\nk1\n\n  k2  \n")
    admins.write_text("root\n")
    monkeypatch.setenv("LIBRA_API_KEY", "env-key")
    monkeypatch.delenv("LIBRA_ADMIN_KEY", raising=False)
    assert read_keys("LIBRA_API_KEY", users) == ["env-key", "k1", "k2"]
    keys = gateway_keys("0.0.0.0", no_auth=False, api_key_file=users, admin_key_file=admins)
    assert keys.enabled and len(keys.users) == 3 and len(keys.admins) == 1
    assert keys.check(bearer("k2"), admin=False) == "ok"
    assert keys.check(bearer("root"), admin=True) == "ok"
