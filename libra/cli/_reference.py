"""The docs' reference pages, generated: the command line from ``libra``'s argument parser,
and every config key from the pydantic models the commands load (type, default, description).

``docs/gen_ref.py`` writes them when the site is built (``make docs``); the tests check
that the config reference lists every key ``libra train --dry-run`` prints.
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import pydantic_core
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from libra.cli import _parser
from libra.launch import RolloutConfig, ServeConfig, TrainRunConfig
from libra.serving import VLLMServerConfig

#: The config each command loads (``--config FILE``, ``--set KEY=VALUE``), in page order.
CONFIGS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("libra train", TrainRunConfig),
    ("libra rollout", RolloutConfig),
    ("libra serve", ServeConfig),
    ("libra vllm", VLLMServerConfig),
)


@dataclass(frozen=True)
class ConfigKey:
    """One key of a config: its dotted path (``[]`` marks a list of tables), the section
    it sits in, and what the model says of it."""

    path: str
    section: str
    type: str
    default: str
    description: str


# ------------------------------------------------------------------------ configs


def config_keys(model: type[BaseModel], prefix: str = "", defaults: Any = None) -> list[ConfigKey]:
    """Every key below ``model``, sections walked in place (a section's keys follow its
    scalar keys); ``defaults`` is the section's default value where a parent sets one,
    whose values override the model's own defaults."""
    keys: list[ConfigKey] = []
    sections: list[tuple[str, type[BaseModel], Any]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        default = _default(field, defaults, name)
        section = _section(field.annotation)
        if section is not None:
            sub, many = section
            sections.append((f"{path}[]" if many else path, sub, None if many else default))
            if not (many or _optional(field.annotation)):
                continue  # a plain section: only its keys are keys
        keys.append(
            ConfigKey(
                path=path,
                section=prefix,
                type=type_name(field.annotation),
                default=_show(default),
                description=_description(field, section),
            )
        )
    for path, sub, default in sections:
        keys += config_keys(sub, path, default)
    return keys


_REQUIRED = object()


def _default(field: FieldInfo, parent: Any, name: str) -> Any:
    if isinstance(parent, BaseModel):
        return getattr(parent, name)
    if field.is_required():
        return _REQUIRED
    return field.get_default(call_default_factory=True)


def _section(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """The model a field's values are tables of, and whether it is a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = get_origin(annotation)
    if origin in (list, tuple):
        args = [arg for arg in get_args(annotation) if arg is not Ellipsis]
        found = _section(args[0]) if len(args) == 1 else None
        return (found[0], True) if found is not None and not found[1] else None
    if origin in (Union, types.UnionType):
        for arg in get_args(annotation):
            if arg is not type(None):
                found = _section(arg)
                if found is not None:
                    return found
    return None


def _optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def _description(field: FieldInfo, section: tuple[type[BaseModel], bool] | None) -> str:
    text = field.description or ""
    if section is not None and not text:
        doc = (section[0].__doc__ or "").strip().split("\n\n")[0]
        text = " ".join(doc.split())
    return " ".join(text.split())


def type_name(annotation: Any) -> str:
    """A type as a reader writes it: ``int``, ``list[str]``, ``"a" or "b"``, ``X or None``."""
    if annotation is type(None):
        return "None"
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Literal:
        return " or ".join(json.dumps(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in args)
    if getattr(annotation, "__metadata__", None) is not None:  # Annotated[...]
        return type_name(args[0])
    if origin is not None:
        inner = ", ".join("..." if arg is Ellipsis else type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _show(value: Any) -> str:
    if value is _REQUIRED:
        return "required"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True) or {}
        return "{}" if not value else json.dumps(value)
    return json.dumps(pydantic_core.to_jsonable_python(value))


def config_markdown() -> str:
    """The configuration reference page."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models each command loads, when the site is built. A",
        "config is a TOML file (`--config FILE`) whose tables are the sections below, and",
        "`--set section.key=value` overrides any key (the value read as TOML). Unknown keys",
        "are refused with the valid ones. `[]` marks a list of tables (`[[fleet.instances]]`).",
        "Defaults shown for a section's keys are the values that section starts with.",
        "",
    ]
    for command, model in CONFIGS:
        lines += [f"## `{command}`", "", _first_paragraph(model), ""]
        keys = config_keys(model)
        for section in dict.fromkeys(key.section for key in keys):
            rows = [key for key in keys if key.section == section]
            title = f"`[{section}]`" if section else "top level"
            lines += [f"### {command.removeprefix('libra ')}: {title}", ""]
            lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            lines += [
                f"| `{key.path.rsplit('.', 1)[-1]}` | `{key.type}` | `{key.default}` | "
                f"{_cell(key.description)} |"
                for key in rows
            ]
            lines.append("")
    return "\n".join(lines)


def _first_paragraph(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split()) or f"`{model.__name__}`."


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# ------------------------------------------------------------------------ the command line


def cli_markdown() -> str:
    """The command-line reference page: every command and subcommand of ``libra``, with
    its usage and options, as the parser has them."""
    parser = _parser()
    lines = [
        "# Command-line reference",
        "",
        "Generated from `libra`'s argument parser when the site is built; `libra COMMAND",
        "--help` prints the same.",
        "",
    ]
    for name, sub, help_text in _commands(parser, "libra"):
        lines += [f"## `{name}`", ""]
        if help_text:
            lines += [help_text[0].upper() + help_text[1:] + ".", ""]
        usage = " ".join(sub.format_usage().split()).removeprefix("usage: ")
        lines += ["```text", usage, "```", ""]
        rows = list(_options(sub))
        if rows:
            lines += ["| argument | what it does | default |", "| --- | --- | --- |"]
            lines += [f"| `{flag}` | {_cell(text)} | {default} |" for flag, text, default in rows]
            lines.append("")
    return "\n".join(lines)


def _commands(
    parser: argparse.ArgumentParser, name: str, help_text: str = ""
) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers or name != "libra":
        yield name, parser, help_text
    for action in subparsers:
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for sub_name, sub in action.choices.items():
            yield from _commands(sub, f"{name} {sub_name}", helps.get(sub_name, ""))


def _options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.option_strings:
            flag = ", ".join(action.option_strings)
            if action.nargs != 0:
                flag += f" {action.metavar or action.dest.upper()}"
        else:
            flag = str(action.metavar or action.dest)
        text = action.help if action.help and action.help != argparse.SUPPRESS else ""
        if action.choices and not isinstance(action.choices, dict):
            text = f"{text} (one of: {', '.join(map(str, action.choices))})".strip()
        default = action.default
        shown = "" if default in (None, False, [], argparse.SUPPRESS) else f"`{default}`"
        yield flag, text, shown
