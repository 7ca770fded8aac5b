"""What serves gunicorn: the lifecycle hooks, the worker class, connection balance,
worker slots and the shared metrics directory.

Imported by ``gunicorn_conf.py`` and the worker class (and /info reads
``allocator.in_use``). Slots, balance tables
and the metrics directory are made in the gunicorn master; the hooks and the
worker's event loop run in each worker's main thread.
"""
