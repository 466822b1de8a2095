"""Benchmarks of deferred against the broker's raw limit and the alternatives.

Run with ``scripts/bench.sh`` (or ``make bench`` / ``make bench-quick``); the
report is written to ``docs/bench/``. Every figure is reported beside a
baseline measured in the same run, because this machine is small and shared.
"""
