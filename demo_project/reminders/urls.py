"""URLs of the reminders app."""

from django.urls import path

from demo_project.reminders import views

app_name = "reminders"

urlpatterns = [
    path("", views.index, name="index"),
    path("reminders/<int:pk>/cancel", views.cancel_reminder, name="cancel"),
    path("healthz", views.healthz, name="healthz"),
]
