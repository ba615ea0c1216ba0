"""Finding envs by name: the ``libra.envs`` entry-point group, or ``module:Class``."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from libra.envs._env import Env

GROUP = "libra.envs"


class UnknownEnvError(LookupError):
    pass


def available_envs() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_env(name: str) -> type[Env]:
    """The env class registered as ``name``, or the class at ``package.module:Class``."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise UnknownEnvError(f"cannot load env {name!r}: {exc}") from exc
    else:
        matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
        if not matches:
            known = ", ".join(available_envs()) or "none installed"
            raise UnknownEnvError(f"unknown env {name!r} (available: {known})")
        target = matches[0].load()
    if not (isinstance(target, type) and issubclass(target, Env)):
        raise UnknownEnvError(f"{name!r} is not an Env subclass")
    return target
