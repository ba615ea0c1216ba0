"""The ASGI helpers the emulated server and the gateway share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libra._asgi import (
    DISCONNECT_EXTENSION,
    ASGIMessage,
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    header,
    on_disconnect,
    read_body,
)

pytestmark = pytest.mark.anyio


def receiving(messages: list[ASGIMessage]) -> Receive:
    pending: Iterator[ASGIMessage] = iter(messages)

    async def receive() -> ASGIMessage:
        return next(pending)

    return receive


def chunk(body: bytes, more: bool = True) -> ASGIMessage:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_a_body_in_chunks_is_joined_and_stopped_past_its_limit() -> None:
    assert await read_body(receiving([chunk(b"ab"), chunk(b"cd", more=False)])) == b"abcd"
    assert await read_body(receiving([chunk(b"ab"), chunk(b"cd", False)]), limit=4) == b"abcd"
    # Without a content-length (chunked), the limit holds as the body arrives.
    with pytest.raises(BodyTooLarge):
        await read_body(receiving([chunk(b"abc"), chunk(b"de"), chunk(b"never")]), limit=4)
    with pytest.raises(ClientDisconnected):
        await read_body(receiving([chunk(b"ab"), {"type": "http.disconnect"}]))


def test_headers_are_found_by_their_lower_case_name() -> None:
    scope = {"headers": [(b"content-type", b"application/json"), (b"x-libra-session", b"s1")]}
    assert header(scope, b"x-libra-session") == b"s1"
    assert header(scope, b"authorization") is None


def test_a_disconnect_callback_goes_where_the_server_offers_the_extension() -> None:
    calls: list[str] = []
    assert not on_disconnect({"type": "http"}, lambda: calls.append("plain"))
    offered: dict[str, dict[str, object]] = {DISCONNECT_EXTENSION: {}}
    assert on_disconnect({"extensions": offered}, lambda: calls.append("offered"))
    assert calls == [] and callable(offered[DISCONNECT_EXTENSION]["callback"])
    # A client gone before the app asked: the callback runs at once.
    gone: dict[str, dict[str, object]] = {DISCONNECT_EXTENSION: {"disconnected": True}}
    assert on_disconnect({"extensions": gone}, lambda: calls.append("gone"))
    assert calls == ["gone"]
