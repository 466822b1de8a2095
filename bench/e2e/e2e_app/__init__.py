"""The end-to-end harness's app: a task that notes its lateness, and a producer.

Both run in their own processes (``python -m django run_deferred_worker`` and
``python -m e2e_app.produce``), against whichever ``deferred`` comes first on
``PYTHONPATH``: the harness must work with older releases, so it uses nothing
but ``defer()``, ``task`` and ``current_job()``.
"""
