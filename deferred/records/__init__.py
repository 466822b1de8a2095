"""What the broker keeps in place of tables: cancels, results, the result cache,
the failed store, pending jobs (from the ledger) and schedule runs.

Each module reads and writes its own records through ``broker``; web
processes and workers share them. It imports ``core``, ``broker``, ``conf``
and ``producer``; nothing of the worker.
"""
