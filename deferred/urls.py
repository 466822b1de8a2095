"""The status page's URLs: ``path("deferred/", include("deferred.urls"))``.

Each page goes through ``admin.site.admin_view``, so the admin site's own
access policy (``has_permission``, e.g. a two-factor site) applies, and the
pages are never cached. ``metrics/`` is for Prometheus, which cannot log
in: it has its own guard, a bearer token and/or an address allow-list.
"""

from django.contrib import admin
from django.urls import path

from deferred import views

app_name = "deferred"

urlpatterns = [
    path("", admin.site.admin_view(views.status_page), name="status"),
    path("failed/retry/", admin.site.admin_view(views.retry), name="retry"),
    path("failed/purge/", admin.site.admin_view(views.purge), name="purge"),
    path("cancel/", admin.site.admin_view(views.cancel), name="cancel"),
    path("pending/move/", admin.site.admin_view(views.move), name="move"),
    path("pending/cancel/", admin.site.admin_view(views.cancel_pending), name="cancel_pending"),
    # Not an admin view: Prometheus does not log in (see DEFERRED['METRICS_TOKEN']).
    path("metrics/", views.metrics, name="metrics"),
]
