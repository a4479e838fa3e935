"""Griffe extension for the API pages: adapt a few docstring habits of this code base.

Loaded by ``mkdocs.yml`` (mkdocstrings, python handler, ``extensions``). The source is not
changed; only what the API pages render:

* ``Example:`` sections are read as doctest examples (the Google parser knows only the
  plural ``Examples:``; the singular would render as plain text);
* ``a, b: description`` in ``Args:`` documents each of ``a`` and ``b``;
* Sphinx roles (``:class:`~ema_ckpt.errors.UsageError```) become inline code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`~?(?P<target>[^`]+)`")
_ARGS_HEADER = re.compile(r"^(?P<indent>[ \t]*)(Args|Arguments|Parameters|Params):[ \t]*$")
_MULTI_NAME = re.compile(r"^(?P<indent>[ \t]+)(?P<names>\*{0,2}\w+(?:,[ \t]*\*{0,2}\w+)+):(?P<rest>[ \t].*)?$")


def _role(match: re.Match[str]) -> str:
    target = match.group("target")
    shown = target.rsplit(".", 1)[-1] if match.group(0).find("`~") != -1 else target
    return f"`{shown}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_names(text: str) -> str:
    """``a, b: text`` items of an ``Args:`` section, written out once per name."""
    lines = text.split("\n")
    out: list[str] = []
    section_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        header = _ARGS_HEADER.match(line)
        if header:
            section_indent = len(header.group("indent"))
            out.append(line)
            i += 1
            continue
        if section_indent is not None and line.strip() and _indent(line) <= section_indent:
            section_indent = None
        item = _MULTI_NAME.match(line) if section_indent is not None else None
        if item is None:
            out.append(line)
            i += 1
            continue
        block_end = i + 1
        while block_end < len(lines) and (not lines[block_end].strip()
                                          or _indent(lines[block_end]) > _indent(line)):
            block_end += 1
        continuation = lines[i + 1:block_end]
        while continuation and not continuation[-1].strip():
            continuation.pop()
        for name in (n.strip() for n in item.group("names").split(",")):
            out.append(f"{item.group('indent')}{name}:{item.group('rest') or ''}")
            out.extend(continuation)
        i = block_end
    return "\n".join(out)


class DocstringCompat(griffe.Extension):
    """Rewrite docstrings as described in the module docstring, before they are parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        value = _EXAMPLE.sub(r"\g<indent>Examples:", docstring.value)
        value = _ROLE.sub(_role, value)
        docstring.value = _split_names(value)
