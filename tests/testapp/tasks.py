"""Tasks the tests defer. They record what happened in a JSON-lines file so
that a worker in another process can report back."""

import json
import os
import time

from deferred import task


def _append(path: str, **fields: object) -> None:
    line = json.dumps({**fields, "at": time.time(), "pid": os.getpid()})
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()


@task
def record(path: str, label: str) -> None:
    _append(path, label=label, event="ran")


@task(name="tests.sleepy")
def sleepy(path: str, label: str, seconds: float) -> None:
    _append(path, label=label, event="start")
    time.sleep(seconds)
    _append(path, label=label, event="end")


@task(name="tests.explode")
def explode(message: str) -> None:
    raise RuntimeError(message)


@task(name="tests.on_other", queue="other")
def on_other(path: str, label: str) -> None:
    _append(path, label=label, event="ran", queue="other")


def read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
