"""A small Django project that schedules reminders with ``deferred``.

Run it against a local RabbitMQ::

    python manage.py migrate
    python manage.py declare_delay_topology   # once per deploy; idempotent
    python manage.py run_deferred_worker      # in a second terminal
    python manage.py runserver

Every setting comes from the environment (see ``settings.py``), so the same
code runs locally and in a container.
"""
