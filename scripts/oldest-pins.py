"""Print the oldest releases pyproject.toml says it supports, as `name==version`.

CI's oldest-releases job installs the wheel with these pins, so a lower bound
in pyproject.toml is a tested claim, not a guess. Read from the file rather
than retyped: raising a floor there moves the job with it.

Which requirements count: the runtime dependencies and the user-facing extras
(demo, cron, prometheus, otel), plus the two packages of the dev extra that
pair with them (django-tasks, what Django 5.2 users install for the backend,
and the OpenTelemetry SDK, which must match the API's release). Tools (ruff,
mypy, pytest...) stay at their newest.
"""

import re
import sys
import tomllib
from pathlib import Path

USER_EXTRAS = ("demo", "cron", "prometheus", "otel")
FROM_DEV = ("django-tasks", "opentelemetry-sdk")
FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)")


def pins(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = list(project["dependencies"])
    for extra in USER_EXTRAS:
        requirements += extras[extra]
    requirements += [r for r in extras["dev"] if FLOOR.match(r) and FLOOR.match(r)[1] in FROM_DEV]
    found: dict[str, str] = {}
    for requirement in requirements:
        match = FLOOR.match(requirement)
        if match is None:
            sys.exit(f"{requirement!r} has no '>=' lower bound to test")
        found[match[1]] = f"{match[1]}=={match[2]}"
    return list(found.values())


if __name__ == "__main__":
    print(" ".join(pins(Path(__file__).resolve().parent.parent / "pyproject.toml")))
