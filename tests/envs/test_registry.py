"""Finding envs: by entry point or ``module:Class``, with one clear line when that fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from libra.envs import Env, UnknownEnvError, env_name, load_env

GOOD = """
from libra.envs import Env

class Here(Env):
    name = "here-env"

    def reset(self, seed: int) -> str:
        return "hello"

    def reward(self, answer: str) -> float:
        return 0.0
"""


@pytest.fixture
def cwd_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory is ``tmp_path``, and not on sys.path (as for the script)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    return tmp_path


def test_module_class_envs_are_found_in_the_current_directory(cwd_only: Path) -> None:
    (cwd_only / "env_found_here.py").write_text(GOOD)
    cls = load_env("env_found_here:Here")
    assert cls.__name__ == "Here" and issubclass(cls, Env)


def test_records_use_the_env_s_own_name() -> None:
    guess = load_env("guess")
    assert env_name("guess", guess) == "guess"

    class Plain(guess):  # type: ignore[valid-type,misc]
        pass

    class Named(guess):  # type: ignore[valid-type,misc]
        name = "bisect"

    assert env_name("tests.x:Plain", Plain) == "plain"
    assert env_name("tests.x:Named", Named) == env_name("guess", Named) == "bisect"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("class Broken(Env)\n    pass\n", r"syntax error at .*env_broken_\d\.py:1: expected ':'"),
        ("import not_a_module_anywhere\n", r"No module named 'not_a_module_anywhere' \(at .*:1\)"),
        ("x = 1\ny = undefined + x\n", r"NameError: name 'undefined' is not defined \(at .*:2\)"),
    ],
)
def test_an_env_module_that_fails_to_import_says_where(
    cwd_only: Path, source: str, message: str
) -> None:
    index = len(list(cwd_only.glob("*.py")))
    (cwd_only / f"env_broken_{index}.py").write_text(source)
    with pytest.raises(UnknownEnvError, match=message) as raised:
        load_env(f"env_broken_{index}:Broken")
    assert "\n" not in str(raised.value)


def test_a_missing_module_or_class_is_named(cwd_only: Path) -> None:
    with pytest.raises(UnknownEnvError, match=r"no module named 'env_nowhere' .*current directory"):
        load_env("env_nowhere:Env")
    (cwd_only / "env_classless.py").write_text(GOOD)
    with pytest.raises(UnknownEnvError, match="module env_classless has no There"):
        load_env("env_classless:There")
