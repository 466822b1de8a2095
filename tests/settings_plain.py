"""The test settings with no ``LOGGING``: the worker's own default logging applies."""

from tests.settings import *  # noqa: F403

LOGGING: dict = {}
