"""The nemesis soak (``python -m bench.soak``): its schedule, and a short run against the
real broker with every kind of fault, checked by ``bench.soak_check``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from bench.soak import KINDS, plan
from tests.conftest import ROOT


def test_the_schedule_is_the_same_for_the_same_seed_and_keeps_its_gaps():
    one = plan(random.Random(7), KINDS, 600, (5, 20), (5, 40), 3)
    assert one == plan(random.Random(7), KINDS, 600, (5, 20), (5, 40), 3)
    assert one != plan(random.Random(8), KINDS, 600, (5, 20), (5, 40), 3)
    assert all(5 <= later.at - earlier.at for earlier, later in pairwise(one))
    assert one[-1].at < 600 and {p.target for p in one} <= {0, 1, 2}
    pauses = [p.seconds for p in one if p.kind == "pause"]
    assert pauses and all(5 <= s <= 40 for s in pauses)


def test_cover_and_restarts_put_their_faults_in_the_schedule():
    for seed in range(20):
        covered = Counter(
            p.kind for p in plan(random.Random(seed), KINDS, 60, (3, 8), (3, 6), 3, cover=True)
        )
        assert set(covered) == set(KINDS), (seed, covered)
        restarts = plan(
            random.Random(seed), ("kill", "pause"), 300, (5, 10), (5, 10), 3, restarts=8
        )
        assert Counter(p.kind for p in restarts)["restart"] >= 8, seed


def test_the_short_soak_s_faults_fit_whatever_the_seed():
    """The short soak's settings (60 s, gaps of 3-8 s, every kind and two restarts): with
    the gaps as drawn they did not fit for 30 % of seeds, and the soak stopped before it
    began; the gaps now close in on 3 s until they fit."""
    for seed in range(500):
        faults = plan(
            random.Random(seed), SHORT_KINDS, 60, (3, 8), (3, 6), 3, restarts=2, cover=True
        )
        kinds = Counter(p.kind for p in faults)
        assert set(kinds) == set(SHORT_KINDS) and kinds["restart"] >= 2, (seed, kinds)
        assert all(p.at < 60 for p in faults), seed


def test_a_schedule_that_cannot_hold_its_faults_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        plan(random.Random(1), KINDS, 20, (5, 20), (5, 40), 3, restarts=5)


def _soak_processes(prefix: str) -> list[int]:
    """The processes a soak started (its workers and producer carry its PREFIX)."""
    found = []
    want = f"BENCH_PREFIX={prefix}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _clean_up(prefix: str, env: dict[str, str]) -> None:
    """What the soak's own clean-up does, again, for a soak that could not do it."""
    for pid in _soak_processes(prefix):
        for signum in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    ctl = os.environ.get("BENCH_RABBITMQCTL", "rabbitmqctl").split()
    for args in (["start_app"], ["await_startup"]):
        subprocess.run([*ctl, *args], capture_output=True, timeout=120)
    subprocess.run(
        [sys.executable, "-m", "django", "declare_delay_topology", "--delete", "--yes", "--force"],
        cwd=ROOT,
        env={**env, "BENCH_PREFIX": prefix},
        capture_output=True,
        timeout=120,
    )


#: The faults of the short soak: every kind (a node kill needs the local cluster).
SHORT_KINDS = tuple(k for k in KINDS if k != "nodekill")


@pytest.mark.alone
@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_runs_nothing_early(tmp_path, broker_url):
    # Given a minute of 50 jobs/s, delays 0-3 s, and every kind of fault at least once,
    # two broker restarts among them;
    seed = random.SystemRandom().randrange(2**31)
    out = tmp_path / "soak"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "bench.settings"}
    env.setdefault("DEFERRED_BROKER_URL", broker_url)
    command = [
        *(sys.executable, "-m", "bench.soak", "--seconds", "60", "--rate", "50"),
        *("--delays", "0-3", "--long-share", "0", "--every", "3-8", "--pause", "3-6"),
        *("--cover", "--restarts", "2", "--drain", "90", "--seed", str(seed), "--out", str(out)),
        *("--faults", ",".join(SHORT_KINDS)),
    ]
    soak = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    prefix = f"deferred-soak-{soak.pid}"
    try:
        # When it runs to its end;
        try:
            output, _ = soak.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            soak.send_signal(signal.SIGTERM)  # its clean-up runs on SIGTERM
            output, _ = soak.communicate(timeout=300)
            pytest.fail(f"the soak (seed {seed}) ran past 10 minutes:\n{output[-5000:]}")
        print(output)  # the report: duplicates and their causes, for the record
        assert (out / "check.json").exists(), f"seed {seed}:\n{output[-5000:]}"
        result = json.loads((out / "check.json").read_text())
        # Then every kind of fault happened, none was lost, none ran early,
        assert set(result["faults"]) == set(SHORT_KINDS), result["faults"]
        assert result["lost"] == [], f"seed {seed}: {result['lost']}"
        assert result["early"] == [], f"seed {seed}: {result['early']}"
        # and every SIGTERM, the nemesis's and the last ones, exited 0.
        assert result["term_exits"] and all(e["code"] == 0 for e in result["term_exits"])
        assert all(e["code"] == 0 for e in result["stop_exits"]), result["stop_exits"]
        assert result["unexpected_exits"] == []
        assert soak.returncode == 0
        # Duplicates happen (at least once), each after a fault that explains it, and
        # each fault makes at most one extra run of a job.
        for duplicate in result["duplicates"]:
            assert duplicate["cause"] is not None, f"seed {seed}: {duplicate}"
            assert duplicate["extra"] <= sum(result["faults"].values()), duplicate
    finally:
        if soak.poll() is None:
            soak.kill()
            soak.wait()
        _clean_up(prefix, env)
    assert _soak_processes(prefix) == []
