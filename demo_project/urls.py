"""The demo's URLs: the reminders page, the admin, and deferred's status page."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    # Staff only: queues, pending jobs by how long they can still wait, failed jobs.
    path("deferred/", include("deferred.urls")),
    path("", include("demo_project.reminders.urls")),
]
