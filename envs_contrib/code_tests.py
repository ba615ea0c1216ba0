"""``code_tests``: write a function; hidden unit tests run it in a sandbox.

Each task (from its seed) asks for one function and carries hidden test cases whose
expected results are computed here, on the host, by a reference implementation. The
``run_tests`` tool writes the model's code into a locked-down container and runs it on
the hidden inputs; the expected results never enter the container, so the model's code
cannot read them. The tool answers with how many tests passed; the reward is the
fraction passed by the last code the model tested.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from libra.envs import Env, SandboxSpec, ToolError, ToolResult, ToolTimeout, tool

_CASES = 12

# Runs inside the sandbox: import the solution, call it on each input read from stdin,
# print one JSON line of results. The solution's own prints are swallowed.
_RUNNER = r"""
import contextlib, io, json, sys
cases = json.load(sys.stdin)
try:
    with contextlib.redirect_stdout(io.StringIO()):
        import solution
    function = getattr(solution, sys.argv[1])
except BaseException as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    raise SystemExit(0)
results = []
for args in cases:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            results.append({"value": function(*args)})
    except BaseException as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps({"results": results}, default=repr))
"""


@dataclass(frozen=True)
class Problem:
    name: str
    signature: str
    description: str
    reference: Callable[..., Any]
    inputs: Callable[[random.Random], list[Any]]


def _words(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + "  ") for _ in range(rng.randint(0, 30)))


def _palindrome_candidate(rng: random.Random) -> str:
    half = "".join(rng.choice("abcAB1 ,") for _ in range(rng.randint(0, 8)))
    return half + half[::-1] if rng.random() < 0.5 else half + rng.choice("xyz")


def _run_length(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{text[i]}{j - i}")
        i = j
    return "".join(out)


def _merge(intervals: list[list[int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _intervals(rng: random.Random) -> list[list[int]]:
    result = []
    for _ in range(rng.randint(0, 6)):
        start = rng.randint(0, 50)
        result.append([start, start + rng.randint(0, 10)])
    return result


PROBLEMS = [
    Problem(
        "second_largest",
        "second_largest(xs: list[int]) -> int",
        "the second largest distinct value in xs (xs has at least two distinct values)",
        lambda xs: sorted(set(xs))[-2],
        lambda rng: [rng.sample(range(-100, 100), rng.randint(2, 9)) * rng.randint(1, 2)],
    ),
    Problem(
        "count_vowels",
        "count_vowels(text: str) -> int",
        "the number of vowels (a, e, i, o, u, either case) in text",
        lambda text: sum(c in "aeiouAEIOU" for c in text),
        lambda rng: [_words(rng)],
    ),
    Problem(
        "is_palindrome",
        "is_palindrome(text: str) -> bool",
        "whether text reads the same backwards, ignoring case and non-alphanumeric characters",
        lambda text: (s := [c.lower() for c in text if c.isalnum()]) == s[::-1],
        lambda rng: [_palindrome_candidate(rng)],
    ),
    Problem(
        "run_length",
        "run_length(text: str) -> str",
        "the run-length encoding of text, e.g. 'aaabcc' -> 'a3b1c2'",
        _run_length,
        lambda rng: ["".join(rng.choice("aab") for _ in range(rng.randint(0, 12)))],
    ),
    Problem(
        "merge_intervals",
        "merge_intervals(intervals: list[list[int]]) -> list[list[int]]",
        "the union of closed intervals [start, end] as sorted, non-overlapping intervals",
        _merge,
        lambda rng: [_intervals(rng)],
    ),
]


class CodeTests(Env):
    """Write a Python function; hidden unit tests score it."""

    system_prompt = (
        "Write the requested Python function. Test it with the run_tests tool, which runs"
        " hidden unit tests and says how many pass. Fix it until all pass, then say 'done'."
    )
    max_turns = 8
    tool_timeout_s = 30.0
    #: The hidden tests' own time limit in the sandbox (within the tool's ``tool_timeout_s``).
    tests_timeout_s: ClassVar[float] = 20.0
    sandbox_spec = SandboxSpec(image="libra/python", memory_mb=256, cpus=1.0, pids=64)

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.problem = rng.choice(PROBLEMS)
        self.inputs = [self.problem.inputs(rng) for _ in range(_CASES)]
        # Round-trip through JSON so expected values compare like the sandbox's results.
        self.expected = json.loads(json.dumps([self.problem.reference(*a) for a in self.inputs]))
        self.passed_fraction = 0.0
        problem = self.problem
        return f"Write a Python function `{problem.signature}` that returns {problem.description}."

    @tool
    async def run_tests(self, code: str) -> ToolResult:
        """Run the hidden unit tests against your code.

        Args:
            code: the complete Python source that defines the function
        """
        await self.sandbox.write_file("solution.py", code.encode())
        result = await self.sandbox.exec(
            ["python3", "-c", _RUNNER, self.problem.name],
            stdin=json.dumps(self.inputs).encode(),
            timeout_s=self.tests_timeout_s,
        )
        if result.timed_out:
            self.passed_fraction = 0.0
            limit = self.tests_timeout_s
            raise ToolTimeout(f"the tests ran longer than {limit:g} s and were stopped")
        report = _last_json_line(result.stdout)
        if report is None or "error" in report:
            self.passed_fraction = 0.0
            detail = report["error"] if report else result.stderr[-500:] or "no output"
            raise ToolError(f"your code could not be loaded: {detail}")
        outcomes = report.get("results", [])
        passed = sum(
            "value" in got and got["value"] == want
            for got, want in zip(outcomes, self.expected, strict=False)
        )
        self.passed_fraction = passed / len(self.expected)
        errors = [o["error"] for o in outcomes if "error" in o]
        summary = f"{passed}/{len(self.expected)} tests passed."
        text = f"{summary} First error: {errors[0]}" if errors else summary
        # A failing test is the tool's own verdict (it predicts more turns), not a guess.
        return ToolResult(text, "success" if passed == len(self.expected) else "failure")

    def reward(self, answer: str) -> float:
        return self.passed_fraction


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        return value if isinstance(value, dict) else None
    return None
