"""A Griffe extension for the API reference (mkdocstrings, `extensions` in mkdocs.yml).

The package's docstrings (written in the notebooks' code cells) head their examples
`Example:`. Google style knows `Examples:` as the section whose `>>>` lines are Python code;
it reads a singular `Example:` as an admonition and renders its `>>>` lines as Markdown, that
is as nested blockquotes run together. This extension renames the section before the
docstrings are parsed, so that each example renders as a highlighted code block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename `Example:` docstring sections to Google style's `Examples:`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
