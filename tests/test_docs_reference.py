"""The generated reference (docs/_ext): every setting is described by its row of the
settings table in conf.py and filed under its topic, every failure reason by the comment on its
constant, every command by its own options; the anchors other pages link to exist."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from sphinx.errors import ExtensionError

from deferred import conf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "_ext"))
reference = importlib.import_module("deferred_reference")


def test_every_setting_has_words_and_a_topic_in_the_table():
    assert [row.key for row in conf.SETTINGS] == list(conf.DEFAULTS)
    blank = [row.key for row in conf.SETTINGS if len(row.doc.split()) < 4]
    assert not blank, f"settings without words in the table (deferred/conf.py): {blank}"
    topics = reference.settings_by_topic(conf.SETTINGS)
    assert sum(len(rows) for rows in topics.values()) == len(conf.SETTINGS)
    assert next(iter(topics)) == "Broker connection"


def test_a_topic_whose_rows_are_apart_fails_the_build():
    rows = [SimpleNamespace(key=key, topic=topic) for key, topic in [("A", "T"), ("B", "U")]]
    assert list(reference.settings_by_topic(rows)) == ["T", "U"]
    with pytest.raises(ExtensionError, match="C under 'T' away from"):
        reference.settings_by_topic([*rows, SimpleNamespace(key="C", topic="T")])


def test_a_setting_anchor_is_the_key_as_written():
    assert reference.setting_anchor("BROKER_URL") == "setting-BROKER_URL"
    assert reference.command_anchor("deferred_failed") == "command-deferred-failed"


def test_a_default_duration_reads_in_its_largest_whole_unit():
    assert reference._default(timedelta(days=3650)) == "3650 days"
    assert reference._default(timedelta(minutes=10)) == "10 min"
    assert reference._default(timedelta(seconds=30)) == "30 s"
    assert reference._default(timedelta(milliseconds=256)) == "256 ms"
    assert reference._default(timedelta(milliseconds=1500)) == "1500 ms"
    assert reference._default("amqp://x") == "'amqp://x'"


#: What Django's create_parser adds to every command, besides -h.
DJANGO_COMMON_OPTIONS = [
    "--version",
    "-v",
    "--verbosity",
    "--settings",
    "--pythonpath",
    "--traceback",
    "--no-color",
    "--force-color",
    "--skip-checks",
]


def _command_names() -> list[str]:
    commands = importlib.import_module("deferred.management.commands")
    return sorted(info.name for info in pkgutil.iter_modules(commands.__path__))


def test_the_commands_page_names_djangos_common_options_once():
    from django.core.management.base import BaseCommand

    parser = BaseCommand().create_parser("manage.py", "any")
    common = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert common == set(DJANGO_COMMON_OPTIONS), "Django's common options changed"
    page = (Path(__file__).resolve().parent.parent / "docs/reference/commands.md").read_text()
    assert all(f"`{option}`" in page for option in DJANGO_COMMON_OPTIONS)


def test_a_commands_help_shows_its_own_options_only():
    helps = {name: "\n".join(reference.command_help(name)) for name in _command_names()}
    for name, text in helps.items():
        assert text.startswith(f"usage: manage.py {name} ")
        words = text.replace("[", " ").replace("]", " ").replace(",", " ").split()
        shown = [option for option in DJANGO_COMMON_OPTIONS if option in words]
        assert not shown, f"{name} shows Django's common options: {shown}"
    assert "--dry-run" in helps["declare_delay_topology"]
    # Subcommands come with their own options.
    assert "usage: manage.py deferred_failed retry" in helps["deferred_failed"]
    assert "--resign" in helps["deferred_failed"]


def _build(source: Path, pages: dict[str, str]) -> tuple[int, Path]:
    """Build ``pages`` with the reference extension, warnings as errors, as the site is."""
    from sphinx.cmd.build import build_main

    source.mkdir()
    (source / "conf.py").write_text(
        'extensions = ["myst_parser", "deferred_reference"]\n'
        'source_suffix = {".md": "markdown"}\n'
        "myst_heading_anchors = 4\n"
    )
    toctree = "\n".join(pages)
    (source / "index.md").write_text(f"# Index\n\n```{{toctree}}\n{toctree}\n```\n")
    for name, text in pages.items():
        (source / f"{name}.md").write_text(text)
    out = source.parent / "html"
    return build_main(["-W", "--keep-going", "-q", "-E", "-b", "html", str(source), str(out)]), out


#: myst-parser itself uses a Sphinx API that Sphinx 11 removes; nothing to act on here.
myst_deprecation = pytest.mark.filterwarnings("ignore:.*MystReferenceResolver.app")

REFERENCE_PAGES = {
    "settings": "# Settings\n\n```{deferred-settings}\n```\n",
    "commands": "# Commands\n\n```{deferred-commands}\n```\n",
    "links": (
        "# Links\n\n"
        "[BROKER_URL](settings.md#setting-BROKER_URL), "
        "[failed jobs](commands.md#command-deferred-failed).\n"
    ),
}


@myst_deprecation
def test_every_setting_and_command_has_an_anchor_other_pages_can_link_to(tmp_path):
    status, out = _build(tmp_path / "docs", REFERENCE_PAGES)
    assert status == 0, "the pages build without warnings"
    settings = (out / "settings.html").read_text()
    for key in conf.DEFAULTS:
        assert f'id="setting-{key}"' in settings
        assert f'href="#setting-{key}"' in settings, "the A-Z list links each setting"
    commands = (out / "commands.html").read_text()
    for name in _command_names():
        assert f'id="command-{name.replace("_", "-")}"' in commands
    assert "--pythonpath" not in commands
    links = (out / "links.html").read_text()
    assert 'href="settings.html#setting-BROKER_URL"' in links
    assert 'href="commands.html#command-deferred-failed"' in links


@myst_deprecation
def test_the_build_fails_when_a_row_is_away_from_its_topic(tmp_path, monkeypatch, capsys):
    # The first row (BROKER_URL, "Broker connection") moved to the end of the table.
    monkeypatch.setattr(conf, "SETTINGS", (*conf.SETTINGS[1:], conf.SETTINGS[0]))
    status, _ = _build(tmp_path / "docs", {"settings": REFERENCE_PAGES["settings"]})
    assert status != 0
    assert "BROKER_URL under 'Broker connection' away from" in capsys.readouterr().err


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
