"""A session's digests: what matches a request to its session and names its task."""

from __future__ import annotations

import hashlib
import json

from libra.gateway._session import digests_of, prompt_key_of
from libra.openai import FunctionCall, Message, ToolCall

#: Text that JSON escapes in every way it can: quotes, backslashes, control characters
#: (short and \u escapes), and what ensure_ascii=False leaves as UTF-8.
AWKWARD = 'a "quote", a \\ back\\slash, \b\f\n\r\t\x00\x01\x1f\x7f, Ünïcode 中文 😀 \u2028\u2029'


def reference_digests(messages: list[Message]) -> list[bytes]:
    """The chain as first defined: each message's fields dumped by the json module."""
    chain, digest = [], b""
    for m in messages:
        calls = [
            [
                c.id,
                c.function.name,
                json.dumps(json.loads(c.function.arguments), sort_keys=True, separators=(",", ":")),
            ]
            for c in m.tool_calls or ()
        ]
        fields = [m.role, m.content or "", calls, m.tool_call_id or ""]
        canonical = json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
        digest = hashlib.blake2b(digest + canonical, digest_size=16).digest()
        chain.append(digest)
    return chain


def test_digests_are_those_of_the_json_modules_canonical_form() -> None:
    """Digests name tasks in records and in the scheduler's saved state: a faster encoder
    must give the same bytes, escapes and all."""
    arguments = json.dumps({"z": AWKWARD, "a": [1, 2.5, None]}, ensure_ascii=False)
    messages = [
        Message(role="system", content=AWKWARD),
        Message(role="user", content=None),
        Message(
            role="assistant",
            content="",
            tool_calls=[ToolCall(id="call_é", function=FunctionCall("f", arguments))],
        ),
        Message(role="tool", content=AWKWARD, tool_call_id="call_é", name="f"),
    ]
    reference = reference_digests(messages)
    assert digests_of(messages) == reference
    assert prompt_key_of(messages, reference) == reference[1].hex()[:16]
