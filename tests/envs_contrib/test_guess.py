"""The guessing game: its answers and its end."""

from __future__ import annotations

import pytest

from envs_contrib.guess import Guess
from libra.envs import ToolError


def test_guess_answers_and_ends() -> None:
    env = Guess()
    env.reset(5)
    secret = env.secret
    assert env.guess(secret - 1) == "higher" if secret > 1 else True
    assert env.guess(secret) == "correct" and env.done
    assert env.reward("") == 1.0
    with pytest.raises(ToolError):
        env.guess(0)
