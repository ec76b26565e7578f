"""Figures in README and docs/ come from sealed bundles: generated blocks between markers, and nothing else.

A generated block::

    <!-- BEGIN GENERATED figures bundle=docs/evidence/quickstart sha256=<hex> -->
    ...written by scripts/render_validation_doc.py --update-blocks...
    <!-- END GENERATED figures -->

``bundle`` is a committed evidence bundle (JSON and logs, no checkpoints) that anyone can ``validation-evidence
verify``; ``sha256`` is the digest of the body as the renderer wrote it, so a hand edit is caught without re-rendering.
The body names the bundle's commit and says "historical" when that commit is not HEAD.

A figure nobody can back with a committed bundle is not shown at all: the page says what is measured where (the
campaign cell, benchmark or test) without the number. The old escape hatch, an ``UNBACKED`` block of hand-measured
figures labelled "not evidence", is gone; :func:`unbacked_blocks` finds any left, which a test requires to be none.

:func:`figure_lines` finds every performance or reliability figure outside generated blocks (fenced code, i.e.
example output, excepted), which a test requires to be none.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(
    r"^<!-- BEGIN GENERATED figures bundle=(?P<bundle>\S+) sha256=(?P<sha>[0-9a-f]{64}) -->$"
)
END = "<!-- END GENERATED figures -->"
UNBACKED_BEGIN = re.compile(r"^<!-- BEGIN UNBACKED (?P<reason>.+) -->$")
FIGURE = re.compile(
    r"[+−±-]\s?\d+(\.\d+)?\s?%"  # a signed percentage: an overhead, a change
    r"|\d+\.\d+\s?%"  # a measured percentage
    r"|\d+(\.\d+)?\s?(GB/s|GiB/s|MB/s|MiB/s|steps/s)"  # a rate
    r"|\d+\.\d+\s?(ms|s|µs)\b"  # a measured duration (configuration values are whole numbers)
    r"|\b\d+(\.\d+)?x\b(?!\d)|\d+\.\d+\s?×"  # a ratio (2 x 2 is a mesh, 28x and 4.00× are measurements)
)


@dataclass(frozen=True, slots=True)
class Block:
    """A generated block: the bundle it names, the digest its marker records, and its body lines."""

    path: Path
    line: int
    bundle: str
    recorded_sha256: str
    body: str

    @property
    def edited(self) -> bool:
        return body_sha256(self.body) != self.recorded_sha256


def body_sha256(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def blocks(path: Path) -> list[Block]:
    """Every generated block in the Markdown file ``path``. Raises ValueError for an unterminated block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    index = 0
    while index < len(lines):
        match = BEGIN.match(lines[index])
        if match:
            end = _closing(lines, index, END, path)
            found.append(
                Block(
                    path,
                    index + 1,
                    match["bundle"],
                    match["sha"],
                    "\n".join(lines[index + 1 : end]),
                )
            )
            index = end
        index += 1
    return found


def replace_body(text: str, bundle: str, body: str) -> str:
    """``text`` with the body of the block naming ``bundle`` replaced by ``body`` and its marker's digest updated."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        match = BEGIN.match(line)
        if match and match["bundle"] == bundle:
            end = _closing(lines, index, END, Path("<text>"))
            head = f"<!-- BEGIN GENERATED figures bundle={bundle} sha256={body_sha256(body)} -->"
            return "\n".join([*lines[:index], head, *body.splitlines(), *lines[end:]]) + "\n"
    raise ValueError(f"no generated block names bundle {bundle}")


def figure_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` for every figure outside generated and fenced blocks."""
    inside = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if inside is None:
            if BEGIN.match(line):
                inside = END
            elif line.startswith("```"):
                inside = "```"
            elif FIGURE.search(line):
                yield number, line
        elif line.startswith(inside):
            inside = None


def unbacked_blocks(path: Path) -> list[int]:
    """Lines of ``<!-- BEGIN UNBACKED ... -->`` markers: hand-measured figures, which no page may hold any more."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [number for number, line in enumerate(lines, start=1) if UNBACKED_BEGIN.match(line)]


def _closing(lines: list[str], start: int, marker: str, path: Path) -> int:
    for index in range(start + 1, len(lines)):
        if lines[index] == marker:
            return index
    raise ValueError(f"{path}:{start + 1}: a generated block is not closed with {marker}")
