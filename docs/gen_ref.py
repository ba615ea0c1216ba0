"""Writes the reference pages when the site is built (mkdocs-gen-files runs this script):
the command line from libra's argument parser, the config keys from its pydantic models."""

import mkdocs_gen_files

from libra.cli._reference import cli_markdown, config_markdown

PAGES = {"reference/cli.md": cli_markdown(), "reference/config.md": config_markdown()}
for name, text in PAGES.items():
    with mkdocs_gen_files.open(name, "w") as page:
        page.write(text)
