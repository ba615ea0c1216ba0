"""``guess``: find a secret number; the oracle answers higher, lower or correct.

A multi-turn env whose tool outcomes decide how long an episode runs: every "higher" or
"lower" means at least one more turn, and a model that bisects finishes in about
log2(range) turns. The reward is 1 for finding the number, less a small cost per extra
guess, so shorter searches score higher.
"""

from __future__ import annotations

import random

from libra.envs import Env, ToolError, tool


class Guess(Env):
    """Find a secret whole number with a higher/lower oracle."""

    system_prompt = (
        "Find the secret number. Call the guess tool; it answers higher, lower or correct."
    )
    max_turns = 16
    low, high = 1, 1000

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.guesses = 0
        return f"I picked a whole number from {self.low} to {self.high}. Find it."

    @tool
    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: your guess
        """
        if not self.low <= number <= self.high:
            raise ToolError(f"guess a number from {self.low} to {self.high}")
        self.guesses += 1
        if number == self.secret:
            self.done = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def reward(self, answer: str) -> float:
        if not self.done:
            return 0.0
        return max(0.1, 1.0 - 0.05 * max(0, self.guesses - 10))
