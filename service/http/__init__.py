"""The HTTP tier: the app factory, routes, request parsing and the access log.

Runs in each gunicorn worker, in its request threads (gthread) or greenlets
(gevent); the model's work is handed to the runtime and its batch thread.
"""
