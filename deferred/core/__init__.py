"""The core: what a job is and how it travels, with no broker I/O and no Django
request in sight.

Jobs and their ids, the topology plan and the delay decomposition, signing,
priorities, retries, schedules, debounce keys, time limits, the running job's
context, tracing, the worker's intake of a message, the ledger's records, the
outcomes a job can have, and the parsers of every setting. It imports nothing
else of deferred: every other package stands on it.
"""
