"""Reference pages generated from the code, so that they cannot drift from it.

Directives:

- ``deferred-settings``: every row of the settings table
  (``deferred.conf.SETTINGS``), grouped by its topic in the table's order, each
  with its anchor, its default and its words;
- ``deferred-commands``: every management command of the app with its
  ``--help``, minus the options Django gives every command;
- ``deferred-failure-reasons``: every reason a job can have in the failed
  queue, with the ``#:`` comment of the constant that names it;
- ``deferred-log-line``: the worker's line per job, as ``deferred.worker``
  writes it, and its outcomes.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import pkgutil
import re
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from anchors import slug
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ExtensionError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective


def _table(headers: list[str], rows: list[list[nodes.Node | str]]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(headers))
    table += group
    for _ in headers:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    group += head
    head += _row(headers)
    body = nodes.tbody()
    group += body
    for row in rows:
        body += _row(row)
    return table


def _row(cells: list[Any]) -> nodes.row:
    row = nodes.row()
    for cell in cells:
        entry = nodes.entry()
        if isinstance(cell, nodes.Node):
            entry += cell
        else:
            entry += nodes.paragraph(text=str(cell))
        row += entry
    return row


def _literal(text: str) -> nodes.paragraph:
    paragraph = nodes.paragraph()
    paragraph += nodes.literal(text=text)
    return paragraph


def _default(value: Any) -> str:
    """A default as a reader would write it: durations in their largest whole unit."""
    if isinstance(value, timedelta):
        ms = value / timedelta(milliseconds=1)
        for unit, size in (("days", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
            if ms >= size and ms % size == 0:
                return f"{ms / size:g} {unit}"
        return f"{ms:g} ms"
    return repr(value)


def settings_by_topic(rows: Iterable[Any]) -> dict[str, list[Any]]:
    """The table's rows by topic, topics and rows in the table's order (the page's).

    A topic's rows stand together in the table; one that comes back after
    another topic is a row out of place, and fails the build rather than
    splitting a section in two.
    """
    topics: dict[str, list[Any]] = {}
    last = None
    for row in rows:
        if row.topic != last and row.topic in topics:
            raise ExtensionError(
                f"The settings table files {row.key} under {row.topic!r} away from that "
                "topic's other rows: keep each topic's rows together (deferred/conf.py)."
            )
        topics.setdefault(row.topic, []).append(row)
        last = row.topic
    return topics


def setting_anchor(key: str) -> str:
    """The HTML id of a setting's section: ``setting-BROKER_URL``.

    The key is kept exactly as it is written in ``DEFERRED`` (docutils would
    lowercase it and turn ``_`` into ``-``), so a link can be written from the
    key alone: ``settings.html#setting-BROKER_URL``, or from another page of
    these docs ``[BROKER_URL](../reference/settings.md#setting-BROKER_URL)``.
    """
    return f"setting-{key}"


def _labelled_section(directive: SphinxDirective, node_id: str, title: nodes.Node) -> nodes.section:
    """A section whose id is ``node_id`` as given, registered as a label of this page.

    Docutils keeps an id set on the node verbatim; the label (named after
    the id, lowercased as docutils does with names) is what lets MyST resolve
    ``[text](page.md#node_id)`` from other pages without a warning, which
    would fail the build.
    """
    section = nodes.section(ids=[node_id], names=[nodes.fully_normalize_name(node_id)])
    section += nodes.title("", "", title)
    directive.state.document.note_explicit_target(section)
    return section


_KEY_RE = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*\b")


def _description(text: str, keys: Iterable[str], current: str) -> nodes.paragraph:
    """``text`` with every other setting it names as a link to that setting.

    Its quotes stay straight: the comments quote values (``"classic"``,
    ``{"base", ...}``) that are copied into settings files as written.
    """
    known = set(keys)
    paragraph = nodes.paragraph(support_smartquotes=False)
    position = 0
    for match in _KEY_RE.finditer(text):
        key = match.group()
        if key not in known:
            continue
        paragraph += nodes.Text(text[position : match.start()])
        literal = nodes.literal(key, key)
        if key == current:
            paragraph += literal
        else:
            paragraph += nodes.reference("", "", literal, refid=setting_anchor(key), internal=True)
        position = match.end()
    paragraph += nodes.Text(text[position:])
    return paragraph


class SettingsDirective(SphinxDirective):
    """Every setting, grouped by topic, each in a section of its own.

    A section (not a table row) per setting gives each one an anchor to link
    to, and lets a long default and its description use the page's full
    width instead of squeezing each other into narrow columns.
    """

    def run(self) -> list[nodes.Node]:
        conf = importlib.import_module("deferred.conf")
        result: list[nodes.Node] = [self._index(conf.DEFAULTS)]
        for topic, rows in settings_by_topic(conf.SETTINGS).items():
            group = _labelled_section(self, f"settings-{slug(topic)}", nodes.Text(topic))
            for row in rows:
                section = _labelled_section(
                    self, setting_anchor(row.key), nodes.literal(row.key, row.key)
                )
                section["classes"].append("deferred-setting")
                default = nodes.paragraph(classes=["deferred-setting-default"])
                default += nodes.Text("Default: ")
                default += nodes.literal(text=_default(row.default))
                section += default
                section += _description(row.doc, conf.DEFAULTS, row.key)
                group += section
            result.append(group)
        return result

    @staticmethod
    def _index(defaults: Iterable[str]) -> nodes.paragraph:
        """Every key A-Z, each a link to its section: the way in for a reader with a name."""
        paragraph = nodes.paragraph(classes=["deferred-settings-index"])
        paragraph += nodes.Text("All settings, A-Z: ")
        for n, key in enumerate(sorted(defaults)):
            if n:
                paragraph += nodes.Text(", ")
            paragraph += nodes.reference(
                "", "", nodes.literal(key, key), refid=setting_anchor(key), internal=True
            )
        paragraph += nodes.Text(".")
        return paragraph


#: The width a command's help is wrapped at: a terminal's, the same on every
#: machine that builds the docs (argparse would otherwise follow $COLUMNS).
HELP_WIDTH = 80


def command_help(name: str) -> list[str]:
    """The help of management command ``name``: its own arguments only.

    Django's ``create_parser`` adds its common options (``--settings``,
    ``--verbosity``...) to every command; printed under each of them they
    bury the few options that differ, so the page lists them once instead.
    The parser is built the way ``create_parser`` builds it, minus those.
    Subcommands (``deferred_failed retry``) follow, each with its own help,
    since the parent's help names them without their options.
    """
    from django.core.management import load_command_class
    from django.core.management.base import CommandParser, DjangoHelpFormatter

    command = load_command_class("deferred", name)
    parser = CommandParser(
        prog=f"manage.py {name}",
        description=command.help or None,
        formatter_class=functools.partial(DjangoHelpFormatter, width=HELP_WIDTH),
    )
    command.add_arguments(parser)
    helps = [parser.format_help().rstrip()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.formatter_class = parser.formatter_class
                helps.append(subparser.format_help().rstrip())
    return helps


def command_anchor(name: str) -> str:
    """The HTML id of a command's section: ``command-deferred-failed``."""
    return f"command-{name.replace('_', '-')}"


class CommandsDirective(SphinxDirective):
    """Every command of the app, A-Z, each in a section other pages link to."""

    def run(self) -> list[nodes.Node]:
        commands = importlib.import_module("deferred.management.commands")
        result: list[nodes.Node] = []
        for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
            section = _labelled_section(self, command_anchor(info.name), nodes.Text(info.name))
            for text in command_help(info.name):
                # Plain text: Pygments would guess Python for some helps and colour them.
                section += nodes.literal_block(text, text, language="text")
            result.append(section)
        return result


#: Where each failure reason is decided, in the order a message meets them.
REASON_MODULES = {
    "deferred.core.intake": ["TOO_LARGE", "BAD_SIGNATURE"],
    "deferred.core.jobs": ["UNDECODABLE", "INVALID"],
    "deferred.records.failures": ["UNKNOWN_TASK", "DELIVERY_LIMIT", "TIMED_OUT", "UNROUTABLE"],
    "deferred.core.retries": ["TASK_ERROR", "RETRIES_EXHAUSTED"],
}


class FailureReasonsDirective(SphinxDirective):
    def run(self) -> list[nodes.Node]:
        rows: list[list[nodes.Node | str]] = []
        for module_name, names in REASON_MODULES.items():
            module = importlib.import_module(module_name)
            docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
            for name in names:
                comment = " ".join(docs.get(("", name), [])).strip()
                rows.append([_literal(getattr(module, name)), comment, _literal(module_name)])
        return [_table(["reason", "what", "decided in"], rows)]


class LogLineDirective(SphinxDirective):
    def run(self) -> list[nodes.Node]:
        outcomes = importlib.import_module("deferred.core.outcomes")
        docs = ModuleAnalyzer.for_module("deferred.core.outcomes").find_attr_docs()
        comment = " ".join(docs.get(("", "JOB_LINE"), [])).strip()
        levels = {logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR"}
        rows: list[list[nodes.Node | str]] = [
            [
                _literal(str(outcome)),
                " ".join(docs.get(("Outcome", outcome.name), [])).strip(),
                levels[outcome.level],
            ]
            for outcome in outcomes.Outcome
        ]
        return [
            nodes.literal_block(
                text=outcomes.JOB_LINE % ("<id>", "<task>", 1, 0.0, "<outcome>", 0.0, "")
            ),
            nodes.paragraph(text=comment),
            _table(["outcome", "what happened", "log level"], rows),
        ]


#: The pages' stylesheet, shipped with the extension that makes their markup.
STATIC = Path(__file__).resolve().parent / "static"


def _add_static_path(app: Sphinx, config: Config) -> None:
    # A new list: the default one may be shared with other builds in the process.
    config.html_static_path = [*config.html_static_path, str(STATIC)]


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("config-inited", _add_static_path)
    app.add_css_file("deferred_reference.css")
    app.add_directive("deferred-settings", SettingsDirective)
    app.add_directive("deferred-commands", CommandsDirective)
    app.add_directive("deferred-failure-reasons", FailureReasonsDirective)
    app.add_directive("deferred-log-line", LogLineDirective)
    return {"parallel_read_safe": True, "version": "1"}
