"""URLs of the reminders app."""

from django.urls import path

from demo_project.reminders import views

app_name = "reminders"

urlpatterns = [
    path("", views.index, name="index"),
    path("live", views.live, name="live"),
    path("changes-digest", views.request_changes_digest, name="changes_digest"),
    path("favicon.svg", views.favicon, name="favicon"),
    path("favicon.ico", views.favicon),
    path("reminders/<int:pk>/cancel", views.cancel_reminder, name="cancel"),
    path("jobs/<str:job_id>/send-now", views.send_now, name="send_now"),
    path("jobs/<str:job_id>/postpone", views.postpone, name="postpone"),
    path("healthz", views.healthz, name="healthz"),
]
