"""The soak's checker on small made-up histories: no broker, no worker.

Each test starts from one consistent history (every job deferred ran once, on
time) and breaks one thing, so that the verdict must change in exactly that way.
"""

from __future__ import annotations

import json
from typing import Any

from bench.soak_check import check, load_jsonl, nearest_fault, report_text

T0 = 1_000_000.0
END = T0 + 200


def call(job_id: str, due: float, outcome: str = "ok") -> dict[str, Any]:
    record = {"id": job_id, "due": T0 + due, "called": T0 + due - 1, "returned": T0 + due - 0.99}
    record["outcome"] = outcome
    if outcome != "ok":
        record["error"] = "BrokerUnavailable"
    return record


def run(job_id: str, due: float, late: float = 0.005, worker: str = "w1.1") -> dict[str, Any]:
    return {
        "id": job_id,
        "attempt": 1,
        "start": T0 + due + late,
        "due": T0 + due,
        "pid": 100 + int(worker[1]),
        "thread": "deferred-job_0",
        "worker": worker,
    }


def fault(kind: str, target: str | None, start: float, end: float, **extra: Any) -> dict:
    return {"kind": kind, "target": target, "start": T0 + start, "end": T0 + end, **extra}


def history() -> tuple[list[dict], list[dict], list[dict]]:
    """Four jobs, each run once on time; three faults and the final SIGTERMs."""
    calls = [call("a", 10), call("b", 20), call("c", 30), call("d", 40)]
    runs = [run("a", 10), run("b", 20, worker="w2.1"), run("c", 30), run("d", 40)]
    faults = [
        fault("kill", "w1.1", 12, 14, down_s=2),
        fault("restart", "broker", 25, 33),
        fault("term", "w2.1", 50, 51, exit_s=0.4, code=0),
        fault("stop", "w1.2", 190, 190.3, exit_s=0.3, code=0),
    ]
    return calls, runs, faults


def verdict(calls: list[dict], runs: list[dict], faults: list[dict], end: float = END) -> dict:
    return check(calls, runs, faults, end, origin=T0)


def test_a_consistent_history_passes():
    result = verdict(*history())
    assert result["passed"]
    assert (result["deferred"], result["raised"], result["ran"], result["runs"]) == (4, 0, 4, 4)
    assert result["lost"] == [] and result["early"] == [] and result["duplicates"] == []
    assert result["faults"] == {"kill": 1, "restart": 1, "term": 1}  # events are not faults
    assert result["term_exits"] == [{"target": "w2.1", "exit_s": 0.4, "code": 0}]
    assert result["stop_exits"] == [{"target": "w1.2", "exit_s": 0.3, "code": 0}]
    assert result["lateness"]["n"] == 4 and round(result["lateness"]["max_ms"]) == 5
    assert result["unknown_runs"] == [] and result["pause_late"]["count"] == 0
    assert "verdict: PASSED" in report_text(result)


def test_a_job_that_never_ran_is_lost_near_the_fault_of_its_due_time():
    calls, runs, faults = history()
    runs = [r for r in runs if r["id"] != "c"]  # due at +30, during the restart
    result = verdict(calls, runs, faults)
    assert not result["passed"]
    assert [item["id"] for item in result["lost"]] == ["c"]
    lost = result["lost"][0]
    assert lost["due_s"] == 30
    assert lost["nearest_fault"]["kind"] == "restart"
    assert lost["due_after_fault_start_s"] == 5
    text = report_text(result)
    assert "lost: 1" in text and "restart broker at +25.0 s" in text and "FAILED" in text
    assert "still in the job queues" not in text


def test_messages_left_in_the_queues_are_shown_beside_the_losses():
    calls, runs, faults = history()
    runs = [r for r in runs if r["id"] != "c"]
    left = {"p.delay.L04.d01": 1}
    result = check(calls, runs, faults, END, origin=T0, leftovers=left)
    assert not result["passed"], "a job stuck in a queue did not run: it counts"
    assert result["leftovers"] == left
    assert "messages still in the job queues at the end: 1\n  1 in p.delay.L04.d01" in (
        report_text(result)
    )


def test_the_nearest_fault_is_the_closest_in_time_when_none_was_under_way():
    _, _, faults = history()
    assert nearest_fault(T0 + 15, faults)["kind"] == "kill"  # 1 s after it ended
    assert nearest_fault(T0 + 22, faults)["kind"] == "restart"  # 3 s before it began
    assert nearest_fault(T0 + 22, []) is None
    # One under way wins over a shorter one that began closer to the instant.
    long_pause = fault("pause", "w2.1", 20, 80)
    assert nearest_fault(T0 + 50, [fault("kill", "w1.1", 51, 52), long_pause]) == long_pause


def test_a_run_before_its_due_time_is_early_by_any_amount():
    calls, runs, faults = history()
    runs[1] = run("b", 20, late=-0.0005, worker="w2.1")
    result = verdict(calls, runs, faults)
    assert not result["passed"]
    assert [(e["id"], e["worker"], e["early_ms"]) for e in result["early"]] == [("b", "w2.1", 0.5)]


def test_a_run_before_the_time_the_producer_asked_for_is_early_too():
    # The job's own due time (from the message) was wrong: the call's says when it is due.
    calls, runs, faults = history()
    runs[0] = {**runs[0], "due": T0 + 9.0, "start": T0 + 9.5}
    result = verdict(calls, runs, faults)
    assert [(e["id"], e["early_ms"]) for e in result["early"]] == [("a", 500.0)]


def test_a_second_run_is_a_duplicate_caused_by_the_fault_on_the_first_runs_worker():
    calls, runs, faults = history()
    # "a" ran on w1.1 at +10.005; w1.1 was killed at +12; w3.1 ran "a" again at +12.5.
    # A close at +11 touched every worker, but the kill came later.
    faults.append(fault("close", "broker", 11, 11.4))
    runs.append({**run("a", 10, worker="w3.1"), "start": T0 + 12.5})
    result = verdict(calls, runs, faults)
    assert result["passed"], "a duplicate breaks no contract"
    assert result["duplicate_extra_runs"] == 1
    (dup,) = result["duplicates"]
    assert (dup["id"], dup["attempt"], dup["extra"]) == ("a", 1, 1)
    assert dup["workers"] == ["w1.1", "w3.1"] and dup["pids"] == [101, 103]
    assert dup["cause"]["kind"] == "kill" and dup["cause"]["target"] == "w1.1"
    assert result["duplicate_causes"] == {"kill": 1}
    assert "cause: kill w1.1 at +12.0 s" in report_text(result)


def test_a_fault_of_another_worker_is_not_the_cause_when_the_broker_was_hit():
    calls, runs, faults = history()
    # "c" ran on w1.1 at +30.005 during the restart (+25 to +33); a kill of w2.1 at
    # +34 is later, but w1.1 was never touched by it: the restart is the cause.
    faults.append(fault("kill", "w2.1", 34, 36))
    runs.append({**run("c", 30, worker="w2.2"), "start": T0 + 36})
    (dup,) = verdict(calls, runs, faults)["duplicates"]
    assert dup["cause"]["kind"] == "restart"


def test_a_duplicate_with_no_fault_near_it_has_no_cause():
    calls, runs, faults = history()
    # "d" ran at +40.005; the latest fault began at +25, more than the window before.
    runs.append({**run("d", 40, worker="w2.1"), "start": T0 + 41})
    (dup,) = verdict(calls, runs, faults)["duplicates"]
    assert dup["cause"] == "none"
    assert verdict(calls, runs, faults)["duplicate_causes"] == {"none": 1}


def test_runs_of_two_attempts_are_no_duplicate():
    calls, runs, faults = history()
    runs.append({**run("b", 25), "attempt": 2})
    assert verdict(calls, runs, faults)["duplicates"] == []


def test_a_raised_call_that_never_ran_is_not_lost_and_one_that_ran_is_counted():
    calls, runs, faults = history()
    calls[2] = call("c", 30, outcome="raised")  # the broker may or may not have taken it
    runs = [r for r in runs if r["id"] != "c"]
    calls.append(call("e", 31, outcome="raised"))
    runs.append(run("e", 31))  # taken after all
    calls.append({**call("f", 32, outcome="raised"), "id": None})  # no id to follow
    result = verdict(calls, runs, faults)
    assert result["passed"] and result["lost"] == []
    assert (result["deferred"], result["raised"], result["raised_ran"]) == (3, 3, 1)
    assert result["raised_without_id"] == 1
    assert result["unknown_runs"] == []


def test_a_job_due_after_the_end_is_not_lost():
    calls, runs, faults = history()
    calls.append(call("late", 250))
    result = verdict(calls, runs, faults)
    assert result["passed"] and result["not_due_at_end"] == 1
    # The same call, with an end after its due time, is a loss.
    assert [item["id"] for item in verdict(calls, runs, faults, END + 100)["lost"]] == ["late"]


def test_a_run_of_an_id_nobody_deferred_is_reported():
    calls, runs, faults = history()
    runs.append(run("ghost", 35))
    assert verdict(calls, runs, faults)["unknown_runs"] == ["ghost"]


def test_lateness_after_the_faults_and_runs_held_up_by_a_pause():
    calls, runs, faults = history()
    faults.append(fault("pause", "w1.1", 55, 80))
    calls += [call("held", 60), call("after", 100)]
    runs += [run("held", 60, late=20.0), run("after", 100, late=0.002)]
    result = verdict(calls, runs, faults)
    assert result["passed"]
    assert result["pause_late"]["count"] == 1 and result["pause_late"]["max_s"] == 20.0
    assert result["pause_late"]["jobs"][0]["id"] == "held"
    assert result["lateness"]["max_ms"] == 20_000.0
    # Only "after" was due once the last fault (the pause, to +80) was 10 s over.
    quiet = result["lateness_quiet"]
    assert quiet["due_after_s"] == 90 and quiet["n"] == 1 and quiet["max_ms"] == 2.0


def test_unexpected_exits_are_reported_and_can_cause_a_duplicate():
    calls, runs, faults = history()
    faults.append(fault("exit", "w1.1", 41, 41, code=1))
    runs.append({**run("d", 40, worker="w2.1"), "start": T0 + 42})
    result = verdict(calls, runs, faults)
    assert result["unexpected_exits"] == [{"target": "w1.1", "exit_s": None, "code": 1}]
    assert result["duplicates"][0]["cause"]["kind"] == "exit"
    assert "exit" not in result["faults"]


def test_load_jsonl_leaves_out_a_line_cut_short(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(run("a", 1)) + "\n" + '{"id": "b", "att')
    assert [r["id"] for r in load_jsonl(path)] == ["a"]
    assert load_jsonl(tmp_path / "missing.jsonl") == []
