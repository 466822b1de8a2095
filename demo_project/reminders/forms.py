"""The form that schedules a reminder."""

from __future__ import annotations

from django import forms

from demo_project.reminders.models import Outcome

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
    outcome = forms.ChoiceField(
        choices=Outcome.choices,
        initial=Outcome.RUN,
        # Optional: a form posted without it (a script, an older page) runs.
        required=False,
        label="Then",
        help_text="Make it fail to see retries and the failed list.",
    )
