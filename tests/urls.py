"""The test project's URLs: the admin (its login) and the status page."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("deferred/", include("deferred.urls")),
]
