from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "bench"
    label = "bench"
