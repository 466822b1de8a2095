"""Reference pages generated from the code, so that they cannot drift from it.

Directives:

- ``deferred-settings``: every key of ``deferred.conf.DEFAULTS`` with its
  default and the comment written above it in ``conf.py``;
- ``deferred-commands``: every management command of the app with its
  ``--help``, as Django's own parser prints it;
- ``deferred-failure-reasons``: every reason a job can have in the failed
  queue, with the ``#:`` comment of the constant that names it;
- ``deferred-log-line``: the worker's line per job, as ``deferred.worker``
  writes it, and its outcomes.
"""

from __future__ import annotations

import ast
import importlib
import io
import logging
import pkgutil
import tokenize
from datetime import timedelta
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
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
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        if seconds >= 86400 and seconds % 86400 == 0:
            return f"{seconds / 86400:g} days"
        return f"{seconds:g} s"
    return repr(value)


def setting_comments(source: str) -> dict[str, str]:
    """The comment lines written just above each key of the ``DEFAULTS`` dict literal."""
    tree = ast.parse(source)
    keys: dict[int, str] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.AnnAssign | ast.Assign)
            and isinstance(node.value, ast.Dict)
            and "DEFAULTS"
            in ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        ):
            for key in node.value.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    keys[key.lineno] = key.value
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    found: dict[str, str] = {}
    for line, key in sorted(keys.items()):
        above: list[str] = []
        n = line - 1
        while n in comments:
            above.insert(0, comments[n])
            n -= 1
        found[key] = " ".join(above)  # empty: the test of the reference fails
    return found


class SettingsDirective(SphinxDirective):
    def run(self) -> list[nodes.Node]:
        conf = importlib.import_module("deferred.conf")
        comments = setting_comments(Path(conf.__file__).read_text())
        rows: list[list[nodes.Node | str]] = [
            [_literal(key), _literal(_default(value)), comments.get(key, "")]
            for key, value in conf.DEFAULTS.items()
        ]
        return [_table(["key", "default", "what"], rows)]


class CommandsDirective(SphinxDirective):
    def run(self) -> list[nodes.Node]:
        from django.core.management import load_command_class

        commands = importlib.import_module("deferred.management.commands")
        result: list[nodes.Node] = []
        for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
            command = load_command_class("deferred", info.name)
            parser = command.create_parser("manage.py", info.name)
            section = nodes.section(ids=[f"command-{info.name.replace('_', '-')}"])
            section += nodes.title(text=info.name)
            section += nodes.literal_block(text=parser.format_help().rstrip())
            result.append(section)
        return result


#: Where each failure reason is decided, in the order a message meets them.
REASON_MODULES = {
    "deferred.intake": ["TOO_LARGE", "BAD_SIGNATURE"],
    "deferred.jobs": ["UNDECODABLE", "INVALID"],
    "deferred.failures": ["UNKNOWN_TASK", "DELIVERY_LIMIT", "UNROUTABLE"],
    "deferred.retries": ["TASK_ERROR", "RETRIES_EXHAUSTED"],
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
        outcomes = importlib.import_module("deferred.outcomes")
        docs = ModuleAnalyzer.for_module("deferred.outcomes").find_attr_docs()
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


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("deferred-settings", SettingsDirective)
    app.add_directive("deferred-commands", CommandsDirective)
    app.add_directive("deferred-failure-reasons", FailureReasonsDirective)
    app.add_directive("deferred-log-line", LogLineDirective)
    return {"parallel_read_safe": True, "version": "1"}
