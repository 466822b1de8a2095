"""The form that schedules a reminder."""

from __future__ import annotations

from django import forms

#: One year: far below ``deferred``'s own maximum delay, and plenty for a demo.
MAX_DELAY_SECONDS = 86400 * 365


class ReminderForm(forms.Form):
    message = forms.CharField(max_length=200)
    delay_seconds = forms.FloatField(
        min_value=0,
        max_value=MAX_DELAY_SECONDS,
        label="Delay (seconds)",
        help_text="Fractions are fine: 0.05 is fifty milliseconds.",
        widget=forms.NumberInput(attrs={"step": "any"}),
    )
