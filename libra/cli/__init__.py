"""The ``libra`` command."""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from collections.abc import Sequence

from libra.cli import _bench, _images, _rollout, _serve, _train, _view, _vllm
from libra.cli._groups import single_failure
from libra.config import RenamedWarning, UsageError
from libra.envs import SandboxError, available_envs
from libra.serving import ModelError, VLLMServerError

# Errors a user can fix from the message alone: print one line, not a traceback. Front
# ends raise ``UsageError`` (a bad flag, config key, env, output path or server); the
# others are the library's own errors whose messages say what to do.
_USER_ERRORS = (
    UsageError,  # AuthError too
    SandboxError,
    ModelError,
    VLLMServerError,
    FileNotFoundError,
    FileExistsError,
    PermissionError,
)


def main(argv: Sequence[str] | None = None) -> int:
    _collect_garbage_less_often()
    warnings.formatwarning = _one_line_when_renamed
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        code: int = args.run(args)
    except _USER_ERRORS as exc:
        print(f"libra: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # one user error that crossed task groups
        only = single_failure(group)
        if not isinstance(only, _USER_ERRORS):
            raise
        print(f"libra: error: {only}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("libra: interrupted", file=sys.stderr)
        return 130
    return code


_format_warning = warnings.formatwarning


def _one_line_when_renamed(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """An old name (a key, a flag) the command still takes: one line, as its errors are."""
    if issubclass(category, RenamedWarning):
        return f"libra: warning: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


def _collect_garbage_less_often() -> None:
    # A rollout keeps many small objects alive (the messages and token lists of thousands
    # of trajectories), and with CPython's default gen-0 threshold (700 allocations) the
    # cyclic collector rescans them so often that it took ~45% of the engine's CPU at
    # 10,000 concurrent trajectories (`libra bench engine`: 741 -> 410 us per call).
    gc.freeze()  # what is alive after start-up lives for the whole command
    gc.set_threshold(100_000, 50, 100)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="libra", description="Agentic RL post-training: rollouts, scheduling, allocation."
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _rollout.add_parser(commands)
    _bench.add_parser(commands)
    _images.add_parser(commands)
    _serve.add_parser(commands)
    _vllm.add_parsers(commands)
    _train.add_parsers(commands)
    _view.add_parser(commands)
    envs = commands.add_parser("envs", help="list the installed envs")
    envs.set_defaults(run=lambda args: print("\n".join(available_envs())) or 0)
    return parser
