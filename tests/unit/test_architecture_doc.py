"""The docs that map the code cannot go stale: the package tree in
docs/architecture.md is the one the modules' docstrings build, and every
production module has a unit test module or a row in docs/testing.md."""

from __future__ import annotations

import re

from tests.architecture import DOC, PACKAGE, ROOT, build_tree, doc_tree

TESTING = ROOT / "docs" / "testing.md"
_ROW = re.compile(r"^\| `([^`]+\.py)` \| (.+?) \| .+ \|$")


def test_the_tree_is_the_codes() -> None:
    assert doc_tree(DOC.read_text("utf-8")) == build_tree(), (
        "docs/architecture.md's tree is stale: run `.venv/bin/python scripts/architecture-tree`"
    )


def _covered_elsewhere() -> dict[str, list[str]]:
    text = TESTING.read_text("utf-8")
    start = text.index("<!-- covered elsewhere")
    table = text[start : text.index("<!-- /covered elsewhere -->", start)]
    rows: dict[str, list[str]] = {}
    for line in table.splitlines():
        match = _ROW.match(line)
        if match:
            rows[match.group(1)] = re.findall(r"`(tests/[^`]+?\.py)", match.group(2))
    return rows


def _unit_test_of(module: str) -> str:
    folder, _, name = module.rpartition("/")
    return f"tests/unit/{folder + '/' if folder else ''}test_{name}"


def test_every_module_has_a_unit_test_module_or_a_row_saying_where_it_is_tested() -> None:
    modules = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" and "emulator" not in path.relative_to(PACKAGE).parts
    )
    rows = _covered_elsewhere()
    missing = [m for m in modules if not (ROOT / _unit_test_of(m)).is_file() and m not in rows]
    assert missing == [], f"no unit test module and no row in docs/testing.md: {missing}"
    stale = [m for m in rows if m not in modules or (ROOT / _unit_test_of(m)).is_file()]
    assert stale == [], f"rows in docs/testing.md for modules gone or now unit-tested: {stale}"
    for module, tests in rows.items():
        assert tests, f"docs/testing.md names no test for {module}"
        absent = [t for t in tests if not (ROOT / t).is_file()]
        assert absent == [], f"docs/testing.md: {module} is tested in files that do not exist"
