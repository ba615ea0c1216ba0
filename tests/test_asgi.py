"""The ASGI helpers the emulated server and the gateway share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libra._asgi import ASGIMessage, BodyTooLarge, ClientDisconnected, Receive, header, read_body

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
