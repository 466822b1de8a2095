"""The code examples of the README and the documentation site stay true.

Every Python block parses (ruff format checks their layout too); every name a
block imports from deferred, or reads as ``deferred.name``, exists; every
``DEFERRED = {...}`` uses known settings keys, and when its values are literals
the settings validation accepts it. The README's quick start runs as written
against the broker.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from deferred import conf
from deferred.producer import tasks
from tests.conftest import total_waiting

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [page for page in PAGES if "_build" not in page.parts]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


EXAMPLES = [
    pytest.param(block, id=f"{page.relative_to(ROOT)}#{number}")
    for page in PAGES
    for number, block in enumerate(python_blocks(page), 1)
]


def test_the_pages_have_examples_to_check():
    assert len(python_blocks(ROOT / "README.md")) >= 1
    assert len(EXAMPLES) >= 20


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def missing_names(block: str) -> list[str]:
    """The names ``block`` takes from deferred that deferred does not have."""
    tree = ast.parse(block)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deferred":
            module = importlib.import_module(node.module or "deferred")
            missing += [
                f"{node.module}.{alias.name}"
                for alias in node.names
                if not hasattr(module, alias.name)
                and not is_module(f"{module.__name__}.{alias.name}")
            ]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deferred":
                    importlib.import_module(alias.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "deferred"
        ):
            module = importlib.import_module("deferred")
            if not hasattr(module, node.attr):
                missing.append(f"deferred.{node.attr}")
    return missing


@pytest.mark.parametrize("block", EXAMPLES)
def test_an_example_uses_only_what_deferred_has(block: str):
    missing = missing_names(block)
    assert not missing, f"the example uses names deferred does not have: {missing}"


def test_the_names_check_above_can_fail():
    block = "import deferred\nfrom deferred import defer, later, testing\ndeferred.soon(1)\n"
    assert missing_names(block) == ["deferred.later", "deferred.soon"]
    assert missing_names("from deferred.testing import eager, lazy") == ["deferred.testing.lazy"]


def deferred_settings(block: str, name: str = "DEFERRED") -> list[ast.Dict]:
    return [
        node.value
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == [name]
        and isinstance(node.value, ast.Dict)
    ]


def example_caches(block: str) -> dict | None:
    """The ``CACHES`` the block sets beside its ``DEFERRED`` (``RESULT_CACHE`` names one)."""
    for literal in deferred_settings(block, "CACHES"):
        return ast.literal_eval(literal)
    return None


@pytest.mark.parametrize("block", [e for e in EXAMPLES if deferred_settings(e.values[0])])
def test_an_example_of_settings_is_accepted_by_the_settings_validation(block: str, tmp_path):
    # The certificate and key paths of an example are the reader's: the check
    # puts an existing file in their place, and validates everything else.
    a_file = tmp_path / "example.pem"
    a_file.write_text("")
    for literal in deferred_settings(block):
        keys = [ast.literal_eval(key) for key in literal.keys if key is not None]
        unknown = sorted(set(keys) - set(conf.DEFAULTS))
        assert not unknown, f"unknown DEFERRED keys in the example: {unknown}"
        try:
            values = [ast.literal_eval(value) for value in literal.values]
        except ValueError:
            continue  # env(...) and the like: only the keys can be checked
        if any(value is Ellipsis for value in values):
            continue
        example = dict(zip(keys, values, strict=True))
        example |= {key: str(a_file) for key in example if key.endswith("_FILE")}
        caches = example_caches(block)
        with override_settings(**({} if caches is None else {"CACHES": caches})):
            conf._build(example)


def test_the_settings_check_above_can_fail():
    (literal,) = deferred_settings('DEFERRED = {"BROKER_URL": "http://nowhere"}')
    keys = [ast.literal_eval(key) for key in literal.keys if key is not None]
    with pytest.raises(ImproperlyConfigured):
        conf._build(dict(zip(keys, map(ast.literal_eval, literal.values), strict=True)))


def test_the_readme_quick_start_runs_as_written(own_topology, raw_channel):
    # Its own topology: the job waits 24 hours, and is deleted with it.
    quick_start = python_blocks(ROOT / "README.md")[0]
    namespace = {"__name__": "readme_quick_start", "reminder": SimpleNamespace(pk=42)}
    try:
        exec(compile(quick_start, "README.md", "exec"), namespace)
        assert isinstance(namespace["send_reminder"], tasks.Task)
        waiting = total_waiting(raw_channel, own_topology)
        assert waiting == 1, "the job is not waiting in the broker"
    finally:
        tasks.unregister("readme_quick_start.send_reminder")
