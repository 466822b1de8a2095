"""Clusters: the nodes and their queue leaders, stuck dead-letters, their repair,
and the watch that keeps an eye on both.

It imports ``core``, ``broker`` and ``conf``.
"""
