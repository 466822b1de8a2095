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


def test_a_key_right_below_another_shares_its_comment():
    source = """
DEFAULTS = {
    # The first group: two keys.
    "A": 1,
    "B": 2,

    "C": 3,
}
"""
    assert reference.setting_comments(source) == {
        "A": "The first group: two keys.",
        "B": "The first group: two keys.",
        "C": "",
    }


def test_every_failure_reason_is_named_and_described():
    from sphinx.pycode import ModuleAnalyzer

    for module_name, names in reference.REASON_MODULES.items():
        module = importlib.import_module(module_name)
        docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        for name in names:
            assert isinstance(getattr(module, name), str)
            assert docs.get(("", name)), f"{module_name}.{name} has no #: comment"


readme_sections = importlib.import_module("readme_sections")


def test_readme_sections_shift_headings_and_point_links_at_their_pages():
    readme = """# deferred
## Use it
Text with [a part](#a-part), [the page](#use-it), [other](#other-page), [gone](#nowhere),
[bench](docs/bench/README.md), [file](scripts/demo.sh) and [web](https://example.com).
### A part
```
### not a heading (code)
```
## Other page
More.
"""
    pages = {"howto/use": ("## Use it", "## Other page"), "howto/other": ("## Other page", None)}
    where = readme_sections._anchors(readme, pages)
    page = readme_sections.render(readme, "howto/use", "## Use it", "## Other page", where)
    assert "## A part" in page and "### not a heading (code)" in page
    assert "[a part](#a-part)" in page  # on this page
    assert "[the page](#use-it)" in page  # this page's own title
    assert "[other](other.md)" in page  # another page: its file
    assert "[gone](#nowhere)" in page  # left as it is: the build fails on it
    assert "[bench](../bench/README.md)" in page
    assert "[file]" not in page and " file and" in page  # a repository file: its text
    assert "[web](https://example.com)" in page
    assert readme_sections.slug("`run_deferred_worker`") == "run_deferred_worker"
    assert (
        readme_sections.slug("django.tasks (Django 6, or 5.2 with the backport)")
        == "djangotasks-django-6-or-52-with-the-backport"
    )
