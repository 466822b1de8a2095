"""Heading anchors as GitHub makes them, so a page's ``#anchor`` links work on
GitHub and on the site alike (``myst_heading_slug_func``)."""

from __future__ import annotations

import re


def slug(title: str) -> str:
    """``django.tasks (Django 6, or 5.2 with the backport)`` ->
    ``djangotasks-django-6-or-52-with-the-backport``."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", ""))
    return text.replace(" ", "-")
