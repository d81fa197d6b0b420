"""The package's tree as docs/architecture.md shows it, built from the code.

Every package and module under ``rollout_session/`` is listed with the first
sentence of its docstring, nested as the folders are. The doc holds the
tree between two markers; `tests/unit/test_architecture_doc.py` checks it is
what this builds, and ``scripts/architecture-tree`` writes it there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

__all__ = ["BEGIN", "DOC", "END", "PACKAGE", "build_tree", "doc_tree", "summary"]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rollout_session"
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- tree: built from the code by scripts/architecture-tree; a test checks it -->"
END = "<!-- /tree -->"

_SENTENCE = re.compile(r"(.+?\.)(?:\s|$)")


def summary(path: Path) -> str:
    """The first sentence of the module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text("utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    match = _SENTENCE.match(paragraph)
    return match.group(1) if match else paragraph


def _lines(package: Path, depth: int) -> list[str]:
    indent = "  " * depth
    lines = [f"{indent}- `{package.name}/`: {summary(package / '__init__.py')}"]
    modules = sorted(p for p in package.glob("*.py") if p.name != "__init__.py")
    for module in modules:
        lines.append(f"{indent}  - `{module.name}`: {summary(module)}")
    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").is_file()):
        lines.extend(_lines(sub, depth + 1))
    return lines


def build_tree() -> str:
    """The tree as the doc should show it (a nested Markdown list)."""
    return "\n".join(_lines(PACKAGE, 0)) + "\n"


def doc_tree(text: str) -> str:
    """The tree the doc shows now (between the markers)."""
    start = text.index(BEGIN) + len(BEGIN)
    return text[start : text.index(END, start)].strip("\n") + "\n"
