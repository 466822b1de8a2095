"""The demo's URLs: everything lives in the reminders app."""

from django.urls import include, path

urlpatterns = [
    path("", include("demo_project.reminders.urls")),
]
