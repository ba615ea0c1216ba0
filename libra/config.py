"""Typed configs: the base of every config section, and loading from TOML with overrides.

Precedence, lowest first: the model's defaults, the command's defaults, the TOML file
(``--config``), the command's own flags, then ``--set section.key=value`` overrides. Each
merges over the ones below it key by key: a section given in a file or with ``--set``
changes only the keys it names (a run's ``[vllm]`` keeps the priority scheduling its
default sets, whatever else it says).
Values given with ``--set`` are read as TOML (``4``, ``true``, ``"text"``, ``[1, 2]``),
falling back to a plain string, so ``--set engine.sampling.temperature=0.7`` does what
it says.
"""

from __future__ import annotations

import difflib
import tomllib
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

import pydantic
from pydantic import BaseModel, ConfigDict
from pydantic_core import ErrorDetails

C = TypeVar("C", bound=pydantic.BaseModel)


class Section(BaseModel):
    """A config section: typed, immutable, and strict about unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class UsageError(Exception):
    """Input the user can fix from the message alone (a flag, a file, an env, a server).

    Every front end shows it as one line (``libra: error: ...``, exit status 2), never
    as a traceback; the message says what is wrong and what would work instead.
    """


class ConfigError(UsageError, ValueError):
    """A config file or override is invalid; the message is one line for the user."""


class RenamedWarning(FutureWarning):
    """An old name (a config key, a flag, a Python name) that still works for one release
    under its new one. The ``libra`` command shows it as one line."""


def renamed(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warn that ``old`` is now called ``new``."""
    message = f"{old} is now {new}: the old name goes in the next release"
    warnings.warn(message, RenamedWarning, stacklevel=stacklevel + 1)


def old_names(package: str, names: Mapping[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that still gives each old name, by its new name and
    value (``{"Old": ("New", New)}``), with a warning."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        new, value = names[name]
        renamed(f"{package}.{name}", f"{package}.{new}")
        return value

    return __getattr__


def renamed_key(data: Any, old: str, new: str, section: str = "") -> Any:
    """``data`` (a section's raw keys, before validation) with key ``old`` moved to
    ``new``, and a warning; both given is an error. ``section``: the keys' prefix."""
    if not isinstance(data, dict) or old not in data:
        return data
    where = f"{section}." if section else ""
    if new in data:
        raise ValueError(f"{where}{old} and {where}{new} are one setting: keep {new}")
    renamed(f"{where}{old}", f"{where}{new}", stacklevel=4)
    data = dict(data)
    data[new] = data.pop(old)
    return data


def load_config(
    model: type[C],
    file: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Any] | None = None,
) -> C:
    data = _section_defaults(model)
    for key, value in (defaults or {}).items():
        _assign(data, key, value)
    _merge(data, _read_toml(file) if file else {})
    for key, value in (flags or {}).items():
        if value is not None:
            _assign(data, key, value)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        _assign(data, key.strip(), _parse_value(text.strip()))
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = "; ".join(_problem(model, e) for e in exc.errors(include_url=False))
        raise ConfigError(f"invalid config: {problems}") from None


def _problem(model: type[BaseModel], error: ErrorDetails) -> str:
    """One validation error in words; an unknown key with the keys of its section and
    the closest of them."""
    where = ".".join(map(str, error["loc"]))
    section = _section_at(model, error["loc"][:-1])
    if error["type"] == "value_error":  # a validator's own words, without pydantic's prefix
        message = str(error["ctx"]["error"]) if "error" in error.get("ctx", {}) else error["msg"]
        return f"{where}: {message}" if where else message
    if error["type"] != "extra_forbidden" or section is None:
        return f"{where}: {error['msg']}"
    valid = list(section.model_fields)
    key = str(error["loc"][-1])
    parent = where.removesuffix(key).rstrip(".")
    close = difflib.get_close_matches(key, valid, n=1)
    guess = f"; did you mean {'.'.join(filter(None, [parent, close[0]]))}?" if close else ""
    name = f"[{parent}]" if parent else "the top level"
    return f"unknown key {where}{guess} (valid keys of {name}: {', '.join(valid)})"


def _section_at(model: type[BaseModel], path: Sequence[int | str]) -> type[BaseModel] | None:
    """The config model at ``path`` below ``model`` (through optional sections and lists
    of sections), or None where the path leaves the models."""
    current: Any = model
    for part in path:
        if isinstance(part, int):
            current = _model_in(current, list_items=True)
        else:
            section = _model_in(current)
            field = section.model_fields.get(part) if section is not None else None
            current = field.annotation if field is not None else None
        if current is None:
            return None
    return _model_in(current)


def _model_in(annotation: Any, *, list_items: bool = False) -> type[BaseModel] | None:
    """The pydantic model an annotation holds: itself, the model of an optional or union,
    or (``list_items``) the model of a list's items."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and not list_items:
        return annotation
    for arg in get_args(annotation):
        if list_items and get_origin(annotation) in (list, tuple):
            return _model_in(arg)
        found = _model_in(arg, list_items=list_items)
        if found is not None:
            return found
    return None


def _read_toml(file: Path) -> dict[str, Any]:
    try:
        with file.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {file}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: {exc}") from None


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _section_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """What ``model``'s sections default to beyond their own classes' defaults (``vllm =
    VLLMServerConfig(max_model_len=8192)``): the base a section given in a file or with
    ``--set`` merges over, key by key, rather than replacing it whole."""
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        default = field.default
        if isinstance(default, BaseModel):
            values = _section_defaults(type(default))
            _merge(values, default.model_dump(exclude_unset=True))
            if values:
                found[name] = values
    return found


def _merge(data: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            _merge(data[key], value)
        else:
            data[key] = value


def _assign(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted}: {part} is not a section")
        node = child
    node[leaf] = value
