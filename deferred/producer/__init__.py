"""The producer side: ``@task``, ``defer()`` and ``adefer()``.

What a web process needs to put a job in the broker. It imports ``core``,
``broker`` and ``conf``; nothing of the worker.
"""
