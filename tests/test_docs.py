"""The docs: every Python block a page marks runnable (```` ```{.python .runnable} ````)
runs, in page order and one namespace per page, against the emulated server; and the
generated reference pages cover what the code has (every key ``libra train --dry-run``
prints, every command of the parser)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from libra.cli._reference import CONFIGS, cli_markdown, config_keys, config_markdown

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
_RUNNABLE = re.compile(r"^```\{\.python \.runnable\}\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _pages_with_examples() -> list[Path]:
    return sorted(path for path in DOCS.rglob("*.md") if _RUNNABLE.search(path.read_text()))


def test_the_guides_have_runnable_examples() -> None:
    pages = {path.relative_to(DOCS).as_posix() for path in _pages_with_examples()}
    assert {"guides/env.md", "guides/rollout.md"} <= pages


@pytest.mark.parametrize(
    "page", _pages_with_examples(), ids=lambda path: path.relative_to(DOCS).as_posix()
)
def test_the_runnable_examples_of_a_page_run(page: Path) -> None:
    text = page.read_text()
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
    for found in _RUNNABLE.finditer(text):
        line = text.count("\n", 0, found.start(1))
        source = "\n" * line + found.group(1)  # tracebacks name the page's own lines
        exec(compile(source, str(page), "exec"), namespace)


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(dotted)


def test_the_names_the_pages_give_are_importable() -> None:
    """A page that names ``libra.package.Name`` names something its package exports (not
    a private module, which may move). Packages alone (``libra.engine``) are not checked."""
    pages = [REPO / "README.md", *DOCS.rglob("*.md")]
    named = {
        name.rstrip(".")
        for page in pages
        for name in re.findall(r"`(libra(?:\.[A-Za-z]\w*){2,})", page.read_text())
    }
    assert len(named) > 10
    for name in sorted(named):
        assert not any(part.startswith("_") for part in name.split(".")), name
        _resolve(name)


def _flatten(table: dict[str, Any], sections: set[str], prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and path in sections:
            keys += _flatten(value, sections, path)
        else:
            keys.append(path)
    return keys


def test_the_config_reference_lists_every_key_of_the_dry_run() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "libra", "train", "--config", "examples/demo.toml", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    printed = tomllib.loads(done.stdout)
    train = dict(CONFIGS)["libra train"]
    keys = config_keys(train)
    sections = {key.section for key in keys}
    listed = {key.path for key in keys}
    flat = _flatten(printed, sections)
    assert len(flat) > 100  # the whole config, its sections walked
    assert [key for key in flat if key not in listed] == []
    page = config_markdown()
    for key in keys:  # each under its section's heading, by its last name
        section = f"`[{key.section}]`" if key.section else "top level"
        heading = f"### train: {section}\n"
        start = page.index(heading)
        end = page.find("\n### ", start + len(heading))
        assert f"| `{key.path.rsplit('.', 1)[-1]}` |" in page[start:end], key.path


def test_every_key_of_the_config_reference_says_what_it_does() -> None:
    """No empty row: every key of every command's config (``libra train``'s and ``libra
    serve``'s hold the others as sections) has a description."""
    configs = dict(CONFIGS)
    assert {"libra train", "libra serve"} <= configs.keys()
    undescribed = [
        f"{command}: {key.path}"
        for command, config in configs.items()
        for key in config_keys(config)
        if not key.description.strip()
    ]
    assert undescribed == []


def test_the_cli_reference_has_every_command() -> None:
    page = cli_markdown()
    for command in ("rollout", "train", "serve", "vllm", "plot", "envs", "bench docs"):
        assert f"## `libra {command}`" in page
    assert "`--dry-run`" in page and "`--set KEY=VALUE`" in page


def test_the_readme_is_a_front_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= 160
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / link).exists(), link
