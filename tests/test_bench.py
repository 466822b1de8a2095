"""The benchmarks keep running as the project changes: a smoke run at tiny scale."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_bench_smoke_run_writes_the_report(tmp_path, broker_url):
    out = tmp_path / "bench"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "bench.settings"}
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["raw"]["publish_confirm_each_per_s"] > 0
    assert results["latency"]["one_thread_ms"]["n"] == 30
    point = results["sustained"]["points"][0]
    assert point["ran"] == point["jobs"] and point["early"] == 0
    assert results["scale"]["lost"] == 0 and results["scale"]["sample"]["ran"] == 200
    assert results["alternatives"]["table_scan"][0]["ran"] == 20
    # The releases scenario, on the system broker alone (no second release to start).
    release_point = results["releases"]["points"][0]
    assert release_point["lost"] == 0 and release_point["early"] == 0
    report = (out / "README.md").read_text()
    for heading in ("## Targets", "## 1. Raw limit", "## 4. Sustained", "## 6. The alternatives"):
        assert heading in report


def test_the_ledger_bench_runs_at_a_small_scale(tmp_path, broker_url):
    out = tmp_path / "ledger.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "bench.settings"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.ledger", "--pending", "3000", "--looks", "20", "--out", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (point,) = json.loads(out.read_text())["points"]
    assert point["checkpoint_rows"] == 3000
    assert point["list_first_page_s"]["max"] > 0 and point["show_ms"]["p99"] > 0
