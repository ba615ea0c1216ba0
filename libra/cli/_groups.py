"""One failure that crossed task groups: each wraps what it lets through in an exception
group, and a user's error must stay one line, whichever groups it crossed."""

from __future__ import annotations


def single_failure(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception ``group`` holds, however deeply nested; None if it holds more."""
    if len(group.exceptions) != 1:
        return None
    only = group.exceptions[0]
    return single_failure(only) if isinstance(only, BaseExceptionGroup) else only
