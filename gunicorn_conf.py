"""Gunicorn configuration: ``gunicorn -c gunicorn_conf.py wsgi:app``.

A thin shell: it reads the settings and the machine, plans the worker topology
(service.topology; ``python -m service.topology`` prints the same plan) and wires
gunicorn's hooks. Everything here runs in the gunicorn master, which must never
touch CUDA or run the model: for CPU workers it builds the model once before the
first fork (service.host.preload), and each worker finishes it in
``wsgi.create_app()``; GPU workers, or SERVE_SHARE_WEIGHTS=off, build their own there.

Each hook below calls one helper per concern; add a concern by adding a line.
"""

import dataclasses
import os
import sys

from gunicorn.arbiter import Arbiter

from service.config.model_spec import check_spec, default_onednn_cache, weights
from service.config.precision_spec import check_device, cpu_flags
from service.config.settings import Settings, cuda_visible_devices
from service.errors import SettingsError
from service.host import allocator, lifecycle, multiproc, open_files, preload
from service.host.balance import Balance, Balanced, ConnectionShares
from service.host.slots import SlotTable
from service.telemetry.logs import logging_config
from service.topology.inventory import first_inventory
from service.topology.plan import plan as plan_topology
from service.topology.table import render

try:
    settings = Settings.from_env()
    # On SIGHUP gunicorn runs this file again while the old workers still hold
    # their GPU memory; a fresh inventory would plan smaller shares (or none).
    # The first one read, kept by the module, plans every reload alike.
    plan = plan_topology(
        settings,
        first_inventory(cuda_visible_devices()),
        [weights(entry.spec) for entry in settings.models],
    )
    # What the planned devices refuse whatever the model (float16 on a CPU, int8
    # on a GPU...), before any worker loads the model only to fail.
    for device in sorted({worker.device for worker in plan.workers}):
        check_device(settings.precision, device)
except SettingsError as exc:
    # A message, not a traceback: the variable and the fix are all the reader needs.
    sys.exit(f"gunicorn_conf.py: {exc}")

bind = settings.bind
worker_class = plan.worker_class
if worker_class == "gthread":
    # gthread that stamps each request's arrival for the latency budget and, with
    # SERVE_BALANCE_CONNECTIONS on, accepts only its share of the connections
    # (service.host.balance).
    worker_class = "service.host.worker.BalancedThreadWorker"
elif worker_class == "gevent":
    # gevent with subprocess left native, so the model can load in its own thread.
    worker_class = "service.host.gevent_worker.GeventWorker"
workers = len(plan.workers)
threads = plan.threads
if plan.worker_connections is not None:
    worker_connections = plan.worker_connections
timeout = plan.timeout_s
# A worker's memory grows with the many tensor shapes of mixed-length batches
# (docs/memory.md); replacing it after SERVE_MAX_REQUESTS bounds
# that. The jitter, a tenth, keeps the workers from being replaced together:
# while one loads its model, the others serve.
max_requests = settings.max_requests
max_requests_jitter = settings.max_requests // 10
graceful_timeout = plan.graceful_timeout_s
# preload_app stays off: the app (its batch thread, its metrics) is each worker's
# own. What every CPU worker builds alike, the model, is built in the master by
# on_starting (service.host.preload), without running it: torch's OpenMP pool
# and CUDA do not survive a fork.
preload_app = False
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
# Every line, gunicorn's included, in the SERVE_LOG_FORMAT format: errors and
# service lines on stderr, access lines on stdout.
logconfig_dict = logging_config(settings.log_format)
# gunicorn's own access log stays off (its default): the service writes one
# access line per request with the request id, route and batch size, and a
# second line for each request would only double the volume.
accesslog = None
# ...and is not built only to be dropped: see service.host.quiet_log.
logger_class = "service.host.quiet_log.NoAccessLogger"

# Gunicorn reads this file again on SIGHUP, which starts an empty table while the
# old workers drain; the new workers then take slots 0.. and the same devices.
slots = SlotTable()
# Each worker's open connections, in memory the workers inherit when forked; a
# few entries spare for workers added past the plan with TTIN.
connection_shares = ConnectionShares(len(plan.workers) + 8)


# -- hooks ------------------------------------------------------------------------


def on_starting(server):
    _choose_allocator(server)
    _raise_open_files(server)
    _check_model()
    _log_plan(server)
    _share_metrics(server)
    _share_run_dir(server)
    _preload(server)


def on_reload(server):
    # SIGHUP: the files as they are now, for the workers about to start. This
    # file was read again, its plan with it: the cache is settled again first.
    _settle_onednn_cache()
    _preload(server)


def pre_fork(server, worker):
    _take_slot(server, worker)
    _freeze_shared(server)


def post_fork(server, worker):
    _enter_slot(server, worker)
    _join_balance(server, worker)


def post_worker_init(worker):
    # In the worker: serve once the model is loaded; exit if the batch thread fails.
    lifecycle.serve_when_loaded(worker)


def pre_request(worker, req):
    # In the worker's request thread: a body that will be refused unread closes its connection.
    lifecycle.close_after_oversized_body(req, settings.max_body_bytes)


def worker_exit(server, worker):
    # In the worker, once it has stopped accepting and its requests are answered.
    lifecycle.drain(worker)


def child_exit(server, worker):
    _free_slot(server, worker)
    _leave_balance(server, worker)
    _drop_live_metrics(worker)


def on_exit(server):
    multiproc.cleanup()


# -- the allocator ------------------------------------------------------------------


def _choose_allocator(server):
    # First of all: executing the master again (to preload jemalloc) is cheap
    # only before it opens its sockets and builds the model. Only gunicorn's own
    # arbiter does it; a test driving these hooks with a stand-in never does.
    if not isinstance(server, Arbiter):
        return
    try:
        decision = allocator.choose(settings.allocator, os.environ)
    except SettingsError as exc:
        sys.exit(f"gunicorn_conf.py: {exc}")
    (server.log.warning if decision.warn else server.log.info)("allocator: %s", decision.reason)
    if decision.preload is not None:
        for handler in server.log.error_log.handlers:
            handler.flush()
        allocator.execute(decision.preload, os.environ)


def _raise_open_files(server):
    # Before any worker is forked: they inherit the limit.
    if plan.worker_connections is None:
        return
    limit, want = open_files.raise_for(plan.worker_connections)
    if limit < want:
        server.log.warning(
            "the open-file limit is %d, below the %d a worker's %d connections need: past it a worker "
            "stops accepting; raise the hard limit (ulimit -Hn) or lower SERVE_WORKER_CONNECTIONS",
            limit,
            want,
            plan.worker_connections,
        )


# -- the model ----------------------------------------------------------------------


def _check_model():
    # Refuse a SERVE_MODEL that can name no model before any worker starts (it
    # loads nothing: no torch, no user code). Here rather than at the top of the
    # file because gunicorn applies --chdir after reading this file, and a
    # relative path is the workers' to resolve from there.
    # The plan was made when this file was read, before --chdir; a relative
    # SERVE_MODEL names its directory only now, so the model's oneDNN default
    # is settled here.
    global settings  # noqa: PLW0603
    try:
        for entry in settings.models:
            check_spec(entry.spec)
        # SERVE_MAX_BODY_BYTES, when unset, follows the model too (an image model
        # directory takes a photo): read again now that its directory is found.
        settings = Settings.from_env()
    except SettingsError as exc:
        sys.exit(f"gunicorn_conf.py: {exc}")
    _settle_onednn_cache()


def _settle_onednn_cache(settled=None):
    # The largest any of the models asks for: the cache is the worker's, shared
    # by its models. A model served in bfloat16 (auto's choice on a CPU with
    # AMX) asks for one: its kernels are oneDNN primitives, rebuilt at every
    # call without it. Before the precision check, which runs with it; again
    # with the precisions it ``settled`` (the master's models, in order), so
    # that a model the check kept in float32 runs as float32 always has: no
    # cache, and no padding to bound its shapes.
    global plan  # noqa: PLW0603
    if settings.onednn_cache is None:
        flags = cpu_flags()
        precisions = settled or [settings.precision] * len(settings.models)
        cache = max(
            default_onednn_cache(entry.spec, precision, flags)
            for entry, precision in zip(settings.models, precisions, strict=True)
        )
        plan = dataclasses.replace(plan, onednn_cache=cache)


def _preload(server):
    # One copy of the model for every CPU worker (service.host.preload): built
    # here, before the first fork, and shared by the workers' pages.
    if not preload.wanted(settings, (worker.device for worker in plan.workers)):
        if settings.share_weights:
            server.log.info("the model is built in each worker: GPU weights cannot pass through a fork")
        return
    try:
        built = preload.build(settings, plan.worker_env(0))
    except Exception as exc:
        # The traceback is for the log; the service stops as when a worker cannot
        # load the model, rather than start workers that would fail alike.
        name = getattr(exc, "failed_model", settings.model)
        server.log.exception("model %r failed to load", name)
        server.log.error(
            "stopping the service: model %r failed to load: %s: %s", name, type(exc).__name__, exc
        )
        multiproc.cleanup()  # on_exit does not run for a master that never started
        sys.exit(Arbiter.WORKER_BOOT_ERROR)
    _settle_onednn_cache([held.precision.precision for held in built])
    for held in built:
        server.log.info(
            "model %s built once for every worker in %.1f s (%s); SERVE_SHARE_WEIGHTS=off builds it in each",
            held.model.name,
            held.seconds,
            held.precision.precision,
        )


def _freeze_shared(server):
    if any(preload.take(settings.for_model(entry), "cpu", entry) for entry in settings.models):
        preload.freeze()


# -- worker topology ----------------------------------------------------------------


def _log_plan(server):
    for line in render(plan).splitlines():
        if line.startswith("warning:"):
            server.log.warning("%s", line)
        elif line:
            server.log.info("%s", line)


def _take_slot(server, worker):
    live = [w.age for w in server.WORKERS.values()]
    worker.serve_slot = slots.assign(worker.age, live)
    if worker.serve_slot >= len(plan.workers):
        server.log.warning(
            "slot %d is past the %d planned workers; it shares slot %d's device",
            worker.serve_slot,
            len(plan.workers),
            plan.worker(worker.serve_slot).slot,
        )


def _enter_slot(server, worker):
    # In the new worker, before it imports wsgi: torch reads these when it starts.
    for name, value in plan.worker_env(worker.serve_slot).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    assigned = plan.worker(worker.serve_slot)
    server.log.info(
        "worker %s takes slot %d: device %s, %d torch threads",
        worker.pid,
        worker.serve_slot,
        assigned.device,
        assigned.torch_threads,
    )


def _free_slot(server, worker):
    slots.release(worker.age)


# -- connections shared evenly between workers ------------------------------------------


def _join_balance(server, worker):
    if (
        settings.balance_connections
        and isinstance(worker, Balanced)
        and worker.serve_slot < connection_shares.capacity
    ):
        worker.balance = Balance(connection_shares, worker.serve_slot)


def _leave_balance(server, worker):
    # At once, rather than when its entry goes stale: the others stop counting it.
    connection_shares.forget(worker.serve_slot, worker.pid)


# -- what one worker settles for all ------------------------------------------------


def _share_run_dir(server):
    # The first worker to check the model's precision leaves its choice here for
    # the others (service.models.precision_cache); once per master, like the metrics.
    path = settings.run_dir or multiproc.prepare(None, prefix="serve-run-")
    os.environ["SERVE_RUN_DIR"] = path


# -- metrics over all workers -------------------------------------------------------

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _share_metrics(server):
    # on_starting runs once per master, not on reloads, so a SIGHUP keeps the
    # directory and the counts in it.
    path = multiproc.prepare(settings.prometheus_multiproc_dir)
    os.environ[METRICS_DIR_ENV] = path
    # prometheus_client reads the variable when first imported, so import it
    # only now, and here in the master: every worker inherits it before gevent
    # patches the worker, so its locks stay native OS locks that the batch
    # thread and request greenlets can share (as service.batching.native's are).
    multiproc.import_client()
    server.log.info("metrics of all workers are kept in %s", path)


def _drop_live_metrics(worker):
    # For every worker that exits, SIGKILL included: its gauges leave the sums,
    # its counters stay. The variable is read back rather than kept in this
    # module because a reload (SIGHUP) runs this file afresh; it is unset only
    # where on_starting never ran.
    path = os.environ.get(METRICS_DIR_ENV)
    if path:
        multiproc.mark_dead(path, worker.pid)
