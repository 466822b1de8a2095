"""The generated reference (docs/_ext): every setting is described by the comment above
it in conf.py, and every failure reason by the comment on its constant."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from deferred import conf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "_ext"))
reference = importlib.import_module("deferred_reference")


def test_every_setting_has_a_description_from_the_code():
    described = reference.setting_comments(Path(conf.__file__).read_text())
    assert set(described) == set(conf.DEFAULTS)
    blank = [key for key, text in described.items() if len(text.split()) < 4]
    assert not blank, f"settings without a comment above them in conf.py: {blank}"


def test_a_key_gets_only_the_comment_right_above_it():
    source = """
DEFAULTS = {
    # The first key,
    # in two lines.
    "A": 1,
    "B": 2,

    # The third.
    "C": 3,
}
"""
    assert reference.setting_comments(source) == {
        "A": "The first key, in two lines.",
        "B": "",
        "C": "The third.",
    }


def test_every_failure_reason_is_named_and_described():
    from sphinx.pycode import ModuleAnalyzer

    for module_name, names in reference.REASON_MODULES.items():
        module = importlib.import_module(module_name)
        docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        for name in names:
            assert isinstance(getattr(module, name), str)
            assert docs.get(("", name)), f"{module_name}.{name} has no #: comment"


anchors = importlib.import_module("anchors")


def test_anchors_are_githubs():
    assert anchors.slug("`run_deferred_worker`") == "run_deferred_worker"
    assert (
        anchors.slug("django.tasks (Django 6, or 5.2 with the backport)")
        == "djangotasks-django-6-or-52-with-the-backport"
    )
    assert anchors.slug("Deployment: systemd and Kubernetes") == "deployment-systemd-and-kubernetes"


def test_every_link_of_the_readme_into_the_repository_exists():
    import re

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme)}
    local = {t for t in targets if t and not t.startswith(("http://", "https://"))}
    assert local, "the README links into the docs"
    missing = sorted(t for t in local if not (root / t).exists())
    assert not missing, missing
