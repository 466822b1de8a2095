"""The test app. With DEFERRED_TEST_KILL_AFTER_RETRY_PUBLISH set, a worker kills
itself right after publishing a retry and before acking the original: the
window the at-least-once guarantee must survive."""

import os
import signal

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"

    def ready(self) -> None:
        if os.environ.get("DEFERRED_TEST_KILL_AFTER_RETRY_PUBLISH"):
            from deferred.worker.pipeline import Pipeline

            original = Pipeline._retry

            def retry_then_die(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                outcome = original(self, *args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
                return outcome

            Pipeline._retry = retry_then_die  # type: ignore[method-assign]
