"""Finding envs by name: the ``libra.envs`` entry-point group, or ``module:Class``.

A ``module:Class`` env is looked for in the current directory first, as ``python -m``
would, so a file next to the user's shell is found whichever way ``libra`` was started.
An env module that fails to import is the user's to fix: the error says where, in one
line, instead of a traceback through the import machinery.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from importlib.metadata import entry_points

from libra.config import UsageError
from libra.envs._env import Env

GROUP = "libra.envs"


class UnknownEnvError(UsageError, LookupError):
    """No env by that name, or it cannot be loaded; the message says why."""


def available_envs() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_env(name: str) -> type[Env]:
    """The env class registered as ``name``, or the class at ``package.module:Class``."""
    if ":" in name:
        target = load_object(name)
    else:
        matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
        if not matches:
            known = ", ".join(available_envs()) or "none installed"
            raise UnknownEnvError(f"unknown env {name!r} (available: {known})")
        target = _importing(name, matches[0].load)
    if not (isinstance(target, type) and issubclass(target, Env)):
        raise UnknownEnvError(f"{name!r} is not an Env subclass")
    return target


def load_object(spec: str, what: str = "env") -> object:
    """The object at ``package.module:name`` (an env class, an agent function), looked
    for in the current directory first; a module that fails to import is one line."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise UnknownEnvError(f"cannot load {what} {spec!r}: write it as package.module:name")
    _look_in_the_current_directory()
    module = _importing(spec, lambda: importlib.import_module(module_name), what)
    if not hasattr(module, attr):
        raise UnknownEnvError(f"cannot load {what} {spec!r}: module {module_name} has no {attr}")
    return getattr(module, attr)


def env_name(name: str, env_cls: type[Env]) -> str:
    """What records call the env loaded as ``name``: its ``Env.name`` if it sets one,
    else the entry point's name, else (for ``module:Class``) the class name in lower case."""
    if env_cls.name:
        return env_cls.name
    return name if ":" not in name else env_cls.__name__.lower()


def _look_in_the_current_directory() -> None:
    # ``python -m libra`` puts the current directory on sys.path; the ``libra`` script
    # does not, and an env written next to the user's shell would not be found.
    if not {"", os.getcwd()} & set(sys.path):
        sys.path.insert(0, os.getcwd())


def _importing(name: str, load: Callable[[], object], what: str = "env") -> object:
    """``load()``, with any failure of the user's module turned into one line."""
    try:
        return load()
    except ModuleNotFoundError as exc:
        if _env_frames(exc):  # the env's own code imports something that is missing
            raise UnknownEnvError(f"cannot load {what} {name!r}: {_where(exc)}") from None
        raise UnknownEnvError(
            f"cannot load {what} {name!r}: no module named {exc.name!r} "
            f"(looked in the current directory, {os.getcwd()}, and the installed packages)"
        ) from None
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else "its source"
        raise UnknownEnvError(
            f"cannot load {what} {name!r}: syntax error at {where}: {exc.msg}"
        ) from None
    except Exception as exc:
        raise UnknownEnvError(f"cannot load {what} {name!r}: {_where(exc)}") from None


def _where(exc: BaseException) -> str:
    """The exception and the innermost line of the env's code that raised it."""
    frames = _env_frames(exc)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _env_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``exc`` in the env's code: not Libra's, the import machinery's or an
    installed library's."""
    libra_dir = os.path.dirname(os.path.dirname(__file__))
    return [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith((libra_dir, "<frozen"))
        and "importlib" not in frame.filename
        and "site-packages" not in frame.filename
    ]
