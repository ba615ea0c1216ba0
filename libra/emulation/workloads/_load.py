"""Finding and reading workload (and fleet) TOML files: shipped ones by name, or paths."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import pydantic

from libra.emulation.workloads._format import Mix, MixFile, Workload


class WorkloadError(ValueError):
    """A workload or fleet file is missing or invalid (the message says where and why)."""


def available_workloads() -> list[str]:
    """Names of the shipped workloads."""
    return sorted(
        entry.name.removesuffix(".toml")
        for entry in resources.files(__package__).iterdir()
        if entry.name.endswith(".toml")
    )


def package_file(name_or_path: str, folder: str = "") -> Path:
    """A shipped file by name (``swe-agent``), or the path given, if it is a file."""
    given = Path(name_or_path)
    if given.suffix == ".toml" or given.exists():
        if not given.is_file():
            raise WorkloadError(f"no such file: {name_or_path}")
        return given
    shipped = resources.files(__package__)
    if folder:
        shipped = shipped / folder
    candidate = shipped / f"{name_or_path}.toml"
    if not candidate.is_file():
        choices = sorted(
            entry.name.removesuffix(".toml")
            for entry in shipped.iterdir()
            if entry.name.endswith(".toml")
        )
        raise WorkloadError(f"unknown name {name_or_path!r}; shipped: {', '.join(choices)}")
    return Path(str(candidate))


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML: {exc}") from exc


def load_workload(name_or_path: str) -> Workload:
    """A shipped workload by name, or a workload file by path; validated."""
    path = package_file(name_or_path)
    data = read_toml(path)
    if "mix" in data:
        raise WorkloadError(f"{path}: a mixture of workloads; only `libra bench sched` runs those")
    try:
        return Workload.model_validate(data)
    except pydantic.ValidationError as exc:
        raise WorkloadError(f"{path}: invalid workload:\n{_brief(exc)}") from exc


def load_step(name_or_path: str) -> Workload | Mix:
    """A workload, or a mixture of workloads (a file with ``[[mix]]`` parts, each a
    workload by name or path, relative to the mixture's folder), by name or path."""
    path = package_file(name_or_path)
    data = read_toml(path)
    if "mix" not in data:
        return load_workload(str(path))
    try:
        mix = MixFile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise WorkloadError(f"{path}: invalid mixture:\n{_brief(exc)}") from exc
    parts = []
    for part in mix.mix:
        given = path.parent / part.workload
        workload = load_workload(str(given) if given.is_file() else part.workload)
        rollout = workload.rollout.model_copy(
            update={"prompts": part.prompts, "history_steps": mix.history_steps}
        )
        parts.append(workload.model_copy(update={"rollout": rollout}))
    if len({part.name for part in parts}) != len(parts):
        raise WorkloadError(f"{path}: a workload appears twice in the mixture")
    return Mix(mix.name, tuple(parts), mix.history_steps)


def _brief(exc: pydantic.ValidationError) -> str:
    return "\n".join(
        f"  {'.'.join(map(str, error['loc'])) or '(top level)'}: {error['msg']}"
        for error in exc.errors()
    )
