"""The tutorial, followed as written: its commands and files, in a scratch folder, against
the broker. Each step of docs/tutorial.md carries a marker (``<!-- tutorial: ... -->``)
saying what a reader does with the block below it; this test does the same, so the
tutorial cannot rot."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_for

TUTORIAL = ROOT / "docs" / "tutorial.md"
STEP = re.compile(r"<!-- tutorial: ([\w-]+)(?: ([^\n]*?))? -->\n(?:\n?```\w*\n(.*?)```)?", re.S)

pytestmark = pytest.mark.slow


def steps() -> list[tuple[str, str, str]]:
    """(action, argument, block) for every marker, in order."""
    return [(m[1], (m[2] or "").strip(), m[3] or "") for m in STEP.finditer(TUTORIAL.read_text())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Reader:
    """Someone following the tutorial in ``folder``, with this interpreter as the venv's."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder = folder
        self.prefix = prefix
        self.env = {**os.environ, "PYTHONPATH": str(folder)}
        self.env.pop("DJANGO_SETTINGS_MODULE", None)
        self.worker: subprocess.Popen[str] | None = None
        self.worker_log = folder / "worker.log"
        self.server: subprocess.Popen[str] | None = None
        self.port = free_port()

    def command(self, line: str) -> list[str]:
        words = shlex.split(line)
        if words[:2] == ["python", "manage.py"]:
            return [sys.executable, *words[1:]]
        if words[0] == "django-admin":
            return [sys.executable, "-m", "django", *words[1:]]
        raise AssertionError(f"the tutorial runs something this test does not know: {line}")

    def run(self, block: str) -> str:
        out = []
        for line in block.strip().splitlines():
            if line.startswith(("python3 -m venv", "pip install")):
                # The reader's venv and install: this test's interpreter has deferred.
                assert 'pip install "path/to/deferred"' in block
                continue
            done = subprocess.run(
                self.command(line),
                cwd=self.folder,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            out.append(done.stdout + done.stderr)
            if line.startswith("django-admin startproject"):
                self.isolate()
        return "\n".join(out)

    def isolate(self) -> None:
        """The one change this test makes: a PREFIX of its own on the shared broker."""
        self.later = f'\nDEFERRED["PREFIX"] = "{self.prefix}"\n'

    def write(self, path: str, block: str, append: bool) -> None:
        target = self.folder / path
        text = (target.read_text() + "\n\n" if append and target.exists() else "") + block
        if path == "mysite/settings.py":
            text += self.later
        target.write_text(text)

    def manage(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``python manage.py ARGS`` in the project, its output captured."""
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=self.folder,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def start_worker(self) -> None:
        self.worker = subprocess.Popen(
            [sys.executable, "manage.py", "run_deferred_worker"],
            cwd=self.folder,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.worker_log.open("a"),
            text=True,
        )
        assert wait_for(lambda: "Worker consuming" in self.log(), 30), self.log()

    def stop_worker(self) -> int:
        assert self.worker is not None
        self.worker.send_signal(signal.SIGINT)
        code = self.worker.wait(30)
        self.worker = None
        return code

    def log(self) -> str:
        return self.worker_log.read_text() if self.worker_log.exists() else ""

    def start_server(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "manage.py", "runserver", "--noreload", str(self.port)],
            cwd=self.folder,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert wait_for(self.answers, 30)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def get(self, url: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{url}", timeout=10) as r:
            return r.read().decode()

    def close(self) -> None:
        for process in (self.worker, self.server):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)


def test_the_tutorial_from_startproject_to_a_recurring_job(tmp_path):
    reader = Reader(tmp_path, f"tutorial-{uuid.uuid4().hex[:8]}")
    seen = []
    try:
        for action, argument, block in steps():
            seen.append(action)
            if action == "run":
                reader.run(block)
            elif action in ("file", "append"):
                reader.write(argument, block, append=action == "append")
            elif action == "servers":
                reader.start_worker()
                reader.start_server()
            elif action == "request":
                assert "deferred by 5 seconds" in reader.get(argument)
                asked = time.monotonic()
            elif action == "worker-says":
                assert wait_for(lambda: argument in reader.log(), 30), reader.log()  # noqa: B023
                if argument.startswith("Welcome"):
                    assert time.monotonic() - asked >= 5 - 0.1  # never early
            elif action == "restart-worker":
                assert reader.stop_worker() == 0
                reader.start_worker()
            elif action == "shell":
                line = block.strip()
                code = line[line.index('"') + 1 : line.rindex('"')]
                done = reader.manage("shell", "-c", code)
                assert done.returncode == 0, done.stderr
            elif action == "run-says":
                out = reader.run(block)
                assert argument in out, out
            elif action == "page":
                made = reader.manage(
                    "createsuperuser",
                    "--noinput",
                    "--username",
                    "admin",
                    "--email",
                    "admin@example.com",
                    DJANGO_SUPERUSER_PASSWORD="tutorial-pass",
                )
                assert made.returncode == 0, made.stderr
                check = (
                    "from django.test import Client; from django.contrib.auth.models import User; "
                    "c = Client(HTTP_HOST='localhost'); "
                    "c.force_login(User.objects.get(username='admin')); "
                    f"r = c.get('{argument}'); print('PAGE', r.status_code, b'Failed' in r.content)"
                )
                done = reader.manage("shell", "-c", check)
                assert "PAGE 200 True" in done.stdout, done.stdout + done.stderr
            elif action == "stop-worker":
                assert reader.stop_worker() == 0
                assert "Worker stopped." in reader.log()
            else:
                raise AssertionError(f"unknown tutorial step {action!r}")
    finally:
        reader.close()
        reader.manage("declare_delay_topology", "--delete", "--yes", "--force")
    assert {"run", "file", "servers", "request", "page", "stop-worker"} <= set(seen)
