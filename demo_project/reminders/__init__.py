"""Reminders: the demo's one app, a message to be marked "ran" after its own delay."""
