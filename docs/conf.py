"""Sphinx configuration: ``make docs`` builds docs/_build/html with warnings as errors.

Sphinx with the furo theme, not MkDocs: the reference is generated from the
code itself (autodoc for the public API, docs/_ext for settings, commands,
failure reasons and the log line), which Sphinx does natively; MyST lets the
pages be written in the same Markdown as the README.
"""

from __future__ import annotations

import sys
from pathlib import Path

import django
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent / "_ext")]

# The app's modules need configured settings to be imported; nothing connects.
settings.configure(
    INSTALLED_APPS=[
        "django.contrib.contenttypes",
        "django.contrib.auth",
        "django.contrib.messages",
        "django.contrib.admin",
        "deferred",
    ],
    SECRET_KEY="documentation-build-only",
    USE_TZ=True,
)
django.setup()

import deferred  # noqa: E402  # after django.setup()

project = "deferred"
# The footer: "Copyright ©" and this (Sphinx writes nothing after the sign without it).
copyright = "the deferred project"
release = version = deferred.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "deferred_reference"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"deferred {release}"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
myst_heading_anchors = 4
# GitHub's anchors: the pages' #links work on GitHub and on the site alike.
myst_heading_slug_func = "anchors.slug"
nitpicky = False
