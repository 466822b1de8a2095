"""Coverage-guided fuzzing of the worker's intake and the failed-queue reader (atheris).

    pip install atheris
    python scripts/fuzz-intake.py -max_total_time=300 [corpus_dir]

Feeds bytes to ``deferred.core.intake.read`` (size, signature, job format) and to
``deferred.records.failures.parse_failed``, half of them with a valid signature so that
the decoder behind the signature check is reached too. Any exception is a
finding: both must map every input to a job or a reason. Not part of the test
suite (the property-based tests in tests/core/test_intake_logic.py are); atheris is not a
dependency.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import atheris
import django

django.setup()
import json  # noqa: E402

from deferred.conf import get_settings  # noqa: E402
from deferred.core import intake, signing  # noqa: E402
from deferred.core.jobs import Job, new_job_id, utcnow  # noqa: E402
from deferred.records import failures  # noqa: E402

# deferred is often installed in editable mode, whose loader instrument_imports()
# does not see: instrument everything loaded (the stdlib's json included).
atheris.instrument_all()

SETTINGS = get_settings()
KEYS = SETTINGS.signing_keys


def one_input(data: bytes) -> None:
    if not data:
        return
    sign, body = data[0] & 1, data[1:]
    headers = signing.sign(body, KEYS) if sign else {}
    result = intake.read(body, headers, SETTINGS)
    if not isinstance(result, Job | intake.Refused):
        raise AssertionError(f"intake.read returned {result!r}")
    failures.parse_failed(body, headers, None, KEYS).to_json()


def seeds(corpus: str) -> None:
    """Start an empty corpus from real messages: a job, a retried one, a failure record."""
    if not os.path.isdir(corpus) or os.listdir(corpus):
        return
    now = utcnow()
    job = Job(
        id=new_job_id(now),
        task="tests.testapp.tasks.record",
        args=("/tmp/x", "label"),
        kwargs={"k": [1, 2.5, None]},
        due=now,
        queue="default",
        created=now,
    )
    record = failures.failure_record(reason="task_error", job=job, body=job.encode())
    bodies = [
        job.encode(),
        job.next_attempt(now, worker="host:1").encode(),
        json.dumps(record).encode(),
    ]
    for n, body in enumerate(bodies):
        for sign in (0, 1):
            with open(os.path.join(corpus, f"seed-{n}-{sign}"), "wb") as f:
                f.write(bytes([sign]) + body)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        if not arg.startswith("-"):
            seeds(arg)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
