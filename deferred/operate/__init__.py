"""Operating a running project: the status snapshot and its pages, metrics for
Prometheus, moving jobs to another broker, removing a topology, exporting its
definitions and the broker permissions it needs.

The top of the house below the public face: it may import every other package.
"""
