"""What the emulated server's handlers share: an error answer in OpenAI's shape, the
response triple they return, and request decoding."""

from __future__ import annotations

from typing import TypeVar

import msgspec

JSON = b"application/json"

Response = tuple[int, bytes, bytes]  # status, body, content type

encode = msgspec.json.Encoder().encode

_Request = TypeVar("_Request")


class HTTPError(Exception):
    """An error answer, in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def decode(decoder: msgspec.json.Decoder[_Request], body: bytes) -> _Request:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as error:  # malformed JSON, or a field of the wrong shape
        raise HTTPError(400, f"Invalid request: {error}") from error
