"""The README's demo command, run from a fresh clone as a new user would.

(The README's test command is what CI runs from a fresh clone, so it proves
itself.) This one clones the repository, runs ``scripts/demo.sh``, schedules a
reminder through the web page and checks that the worker ran it.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import socket
import sqlite3
import subprocess
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from deferred.broker import admin_channel
from deferred.conf import _build
from deferred.core.topology import plan_topology
from demo_project import settings as demo_settings
from tests.conftest import ROOT, wait_for

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _processes_under(folder: Path) -> list[str]:
    """Command lines of the processes run from ``folder``: the demo's virtualenv is there."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if str(folder) in line:
            found.append(line)
    return found


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_demo_command_from_a_fresh_clone(tmp_path: Path, broker_url: str) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    port = free_port()
    prefix = f"deferred-demo-test-{uuid.uuid4().hex[:8]}"
    database = tmp_path / "demo.sqlite3"
    env = {
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "PORT": str(port),
        "DEFERRED_PREFIX": prefix,
        "DEFERRED_BROKER_URL": broker_url,
        "DATABASE_URL": f"sqlite:///{database}",
    }
    log = tmp_path / "demo.log"
    demo = subprocess.Popen(
        ["bash", "scripts/demo.sh"],
        cwd=clone,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    base = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
    )

    def page() -> str:
        with opener.open(base + "/", timeout=5) as response:
            return str(response.read().decode())

    def serving() -> bool:
        try:
            return "Delay" in page()
        except OSError:
            return demo.poll() is not None

    try:
        assert wait_for(serving, 300, interval=1), log.read_text()
        assert demo.poll() is None, log.read_text()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page())
        assert token, page()
        form = urllib.parse.urlencode(
            {
                "csrfmiddlewaretoken": token.group(1),
                "message": "water the plants",
                "delay_seconds": "0.3",
            }
        ).encode()
        request = urllib.request.Request(base + "/", data=form, headers={"Referer": base + "/"})
        with opener.open(request, timeout=10) as response:
            assert "water the plants" in response.read().decode()

        def ran() -> list[tuple[str, str]]:
            with sqlite3.connect(database) as db:
                return db.execute(
                    "SELECT due_at, ran_at FROM reminders_reminder WHERE ran_at IS NOT NULL"
                ).fetchall()

        assert wait_for(ran, 20), log.read_text()
        ((due_at, ran_at),) = ran()
        assert ran_at >= due_at, "the reminder ran early"
        assert 'class="pending"' not in page()

        # A second demo on the same port says so, and which variable picks another.
        second = subprocess.run(
            ["bash", "scripts/demo.sh"],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"Port {port} is taken" in second.stderr and "PORT=" in second.stderr
        assert "Demo running" not in second.stdout

        # SIGTERM to the script alone (as `kill PID` does) stops all of it.
        demo.send_signal(signal.SIGTERM)
        demo.wait(60)
        assert not _processes_under(clone), _processes_under(clone)

        # Started again (installed already), SIGINT to the script alone stops all of it too.
        demo = subprocess.Popen(
            ["bash", "scripts/demo.sh"],
            cwd=clone,
            env=env,
            stdout=log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # As from a terminal: a shell started in the background (CI under nohup,
            # say) ignores SIGINT, and bash cannot trap a signal ignored on entry.
            preexec_fn=_default_sigint,
        )
        assert wait_for(serving, 120, interval=1), log.read_text()
        assert demo.poll() is None, log.read_text()
        demo.send_signal(signal.SIGINT)
        demo.wait(60)
        assert not _processes_under(clone), _processes_under(clone)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)
        try:
            demo.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
        # The demo's own DEFERRED, defaults included: a plan written out here
        # went stale when a default changed and left the demo's queues behind.
        plan = plan_topology(_build({**demo_settings.DEFERRED, "PREFIX": prefix}))
        with admin_channel(broker_url) as admin:
            declared = admin.queue_exists(plan.ready_queues["default"].name)
            admin.delete_everything(plan)
            left = len(admin.missing(plan)) < len(plan.all_exchanges) + len(plan.all_queues)
    assert "Worker stopped." in log.read_text()
    assert declared, "the plan deleted is not the one the demo declared"
    assert not left, "the demo's topology is still on the broker"
