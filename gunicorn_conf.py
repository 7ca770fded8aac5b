"""Gunicorn configuration: ``gunicorn -c gunicorn_conf.py wsgi:app``.

Reads the service's settings once and derives the worker topology from the
machine. Everything here runs in the gunicorn master, which must never touch
torch or CUDA: the model is built in each worker by ``wsgi.create_app()``.
"""

import os

from service.settings import Settings

settings = Settings.from_env()

usable_cores = len(os.sched_getaffinity(0))

bind = settings.bind
worker_class = settings.worker_class
workers = settings.workers or usable_cores
# workers x torch threads <= cores: more would oversubscribe the CPU.
torch_threads = settings.torch_threads or max(1, usable_cores // workers)
# gthread's thread count caps how many requests a worker's batcher can ever see
# at once; the extra threads keep /healthz and /metrics answering under load.
threads = settings.threads or settings.max_batch_size + 8

# preload_app stays off: torch's OpenMP pool and CUDA do not survive a fork, so
# each worker imports wsgi (and loads its model) after it is forked.
preload_app = False
timeout = 60
graceful_timeout = 30
# Idle seconds a keep-alive connection stays open. Behind nginx (deploy/nginx.conf)
# this must outlast nginx's upstream keepalive_timeout (60 s there): if gunicorn
# closes an idle connection first, nginx can send the next request on it at the
# moment the close is in flight, and that client sees a 502. With gunicorn holding
# on longer, nginx always retires its idle connections first. Idle connections
# cost gthread and gevent workers a socket, not a thread.
keepalive = 75
# Proxies whose X-Forwarded-Proto (and friends) gunicorn believes: nginx's address.
forwarded_allow_ips = ",".join(settings.forwarded_allow_ips)
# The control socket's default path is one per user, which several services on
# one host (or a test suite) would fight over; nothing here uses it.
control_socket_disable = True

# Workers read their settings from the environment; hand them the planned threads.
os.environ["SERVE_TORCH_THREADS"] = str(torch_threads)
