"""The house by role (docs/explanation/layout.md): each package of deferred imports
only the packages below it, read from the code's own import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import deferred

#: The package as Python imports it: this checkout's, or the installed wheel's.
PACKAGE = Path(deferred.__file__).resolve().parent

#: What each package may import, as the layout page draws it. The public face
#: (the modules at the top of deferred/) may import any of them.
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "broker": {"core"},
    "conf": {"core", "broker"},
    "producer": {"core", "broker", "conf"},
    "records": {"core", "broker", "conf", "producer"},
    "cluster": {"core", "broker", "conf"},
    "django_tasks": {"core", "broker", "conf", "producer", "records"},
    "worker": {"core", "broker", "conf", "producer", "records", "cluster", "django_tasks"},
    "operate": {
        "core",
        "broker",
        "conf",
        "producer",
        "records",
        "cluster",
        "django_tasks",
        "worker",
    },
}


def imported_parts(path: Path) -> set[str]:
    """The parts of deferred (a package, or a module at the top) that ``path`` imports,
    at its top or inside a function alike."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "deferred":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from deferred import broker, defer...
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "deferred" and len(parts) > 1:
                    found.add(parts[1])
    return found


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_a_package_imports_only_the_ones_below_it(part: str) -> None:
    files = [PACKAGE / f"{part}.py"] if part == "conf" else sorted((PACKAGE / part).rglob("*.py"))
    assert files, f"no files for {part}"
    known = set(MAY_IMPORT) | {p.stem for p in PACKAGE.glob("*.py")}
    wrong = {
        f"{path.relative_to(PACKAGE)} -> {target}"
        for path in files
        for target in imported_parts(path)
        if target in known and target != part and target not in MAY_IMPORT[part]
    }
    assert not wrong, f"imports the layout does not allow: {sorted(wrong)}"


def test_every_package_of_deferred_is_in_the_layout() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"management", "templates"} == set(MAY_IMPORT) - {"conf"}


def test_the_check_sees_an_import_the_layout_forbids(tmp_path: Path) -> None:
    # A core module that reached up into the worker would be found, in a function too.
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from deferred.worker.pool import Pool\n")
    assert imported_parts(module) == {"worker"}
    assert "worker" not in MAY_IMPORT["core"]
