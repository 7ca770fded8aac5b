"""Render deploy/nginx.conf for one backend or several.

Service limits come from the same SERVE_* variables the service reads (parsed by
service.config.settings, so a bad value fails here as it would there); where nginx
listens, which backends it spreads load over and who may read /metrics come from
the arguments, and how many requests a backend takes at once from the service's
own plan for this host unless --max-in-flight says. Standard library only, so it
runs on a host without the service's dependencies:

    SERVE_MAX_BODY_BYTES=2097152 python scripts/deploy/render_nginx.py \\
        --backend 10.0.0.11:8000 --backend 10.0.0.12:8000 --listen 80 \\
        --metrics-allow 10.9.0.0/16 --prefix /var/lib/serve-nginx -o /etc/nginx/nginx.conf
"""

from __future__ import annotations

import argparse
import ast
import ipaddress
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from service.config.settings import Settings  # noqa: E402
from service.errors import SettingsError  # noqa: E402
from service.topology.inventory import Inventory, read_inventory  # noqa: E402
from service.topology.plan import PROBE_HEADROOM, plan  # noqa: E402

TEMPLATE = ROOT / "deploy" / "nginx.conf"
GUNICORN_CONF = ROOT / "gunicorn_conf.py"

# nginx waits this much longer than the service's own request timeout, so that a
# request the service times out gets the service's 504, not nginx's.
PROXY_TIMEOUT_MARGIN_S = 5
# Bodies up to this size are buffered in memory; larger ones (up to the body
# limit) go to a temp file, so a burst of large bodies cannot exhaust memory.
BODY_BUFFER_BYTES = 128 * 1024
MAX_NEXT_UPSTREAM_TRIES = 3

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# Paths and addresses end up inside nginx directives: no spaces, quotes, braces or ';'.
_UNSAFE = re.compile(r"[\s;{}'\"#$\\]")


@dataclass(frozen=True)
class Options:
    """Everything nginx-side; the service's limits come from Settings."""

    prefix: str
    backends: tuple[str, ...] = ("127.0.0.1:8000",)
    listen: str = "127.0.0.1:8080"
    metrics_allow: tuple[str, ...] = ("127.0.0.1", "::1")
    access_log: str | None = None
    error_log: str | None = None
    worker_processes: str = "auto"
    user: str | None = None
    upstream_keepalive: int = 32
    upstream_keepalive_timeout_s: int = 60
    max_fails: int = 3
    fail_timeout_s: int = 10
    connect_timeout_s: int = 2
    next_upstream_tries: int | None = None
    # Requests at one backend at once (max_conns); None: as the service plans this host.
    max_in_flight: int | None = None


def gunicorn_keepalive(path: Path = GUNICORN_CONF) -> int:
    """The ``keepalive = N`` in gunicorn_conf.py, read without running it (the master's config)."""
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "keepalive" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int)
        ):
            return node.value.value
    raise ValueError(f"{path} has no 'keepalive = <integer>' line")


def render(template: str, options: Options, settings: Settings, keepalive_s: int) -> str:
    """The config text: ``template`` with every ``{{name}}`` filled in.

    Pure, but for the default ``max_in_flight``: without one, this host's
    inventory is read to plan the service as it would run here.
    """
    _check(options, keepalive_s)
    timeout_s = math.ceil(settings.request_timeout_ms / 1000)
    access_log = options.access_log or f"{options.prefix}/access.log"
    per_backend = options.max_in_flight or in_flight_per_backend(settings)
    server_params = (
        f"max_fails={options.max_fails} fail_timeout={options.fail_timeout_s}s max_conns={per_backend}"
    )
    values = {
        "prefix": options.prefix,
        "error_log": options.error_log or f"{options.prefix}/error.log",
        "access_log": "off" if options.access_log == "off" else f"{access_log} serve",
        "worker_processes": options.worker_processes,
        "user": f"user {options.user};\n" if options.user else "",
        "listen": options.listen,
        "servers": "\n".join(f"        server {b} {server_params};" for b in options.backends),
        "upstream_keepalive": str(options.upstream_keepalive),
        "upstream_keepalive_timeout": str(options.upstream_keepalive_timeout_s),
        "max_body_bytes": str(settings.max_body_bytes),
        "body_buffer_bytes": str(min(settings.max_body_bytes, BODY_BUFFER_BYTES)),
        "request_timeout_ms": str(settings.request_timeout_ms),
        "connect_timeout": str(options.connect_timeout_s),
        "proxy_timeout": str(timeout_s + PROXY_TIMEOUT_MARGIN_S),
        # No new try once a whole request timeout has passed since the first.
        "next_upstream_timeout": str(timeout_s),
        "next_upstream_tries": str(
            options.next_upstream_tries or min(len(options.backends), MAX_NEXT_UPSTREAM_TRIES)
        ),
        "max_in_flight": str(per_backend),
        "metrics_allow": "\n".join(f"            allow {net};" for net in options.metrics_allow),
    }

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ValueError(f"the template has a placeholder {{{{{name}}}}} that the renderer does not know")
        return values[name]

    return _PLACEHOLDER.sub(fill, template)


def in_flight_per_backend(settings: Settings, inventory: Inventory | None = None) -> int:
    """Requests a backend takes at once as the service plans it on this host (``inventory``).

    A full batch per worker and a few more: what a gthread worker takes at once
    (its request threads), max batch size + PROBE_HEADROOM for gevent, one for
    sync. More in flight only waits longer: a worker runs one batch at a time,
    and a request past the next batch is one the service would refuse for its
    latency budget, at the cost of its request path, while nginx refuses it in
    microseconds (docs/overload.md measures 144, 272 and 640 a backend). For
    backends unlike this host (GPUs, other core counts) pass --max-in-flight.
    """
    try:
        planned = plan(settings, inventory or read_inventory())
    except SettingsError as exc:
        raise SettingsError(f"{exc}; to render for other hosts, pass --max-in-flight") from None
    if planned.worker_class == "gthread":
        per_worker = planned.threads
    elif planned.worker_class == "gevent":
        per_worker = settings.max_batch_size + PROBE_HEADROOM
    else:
        per_worker = 1
    return len(planned.workers) * per_worker


def _check(options: Options, keepalive_s: int) -> None:
    if not options.backends:
        raise SettingsError("at least one --backend is needed")
    for backend in options.backends:
        if not _address_ok(backend, port_alone=False):
            raise SettingsError(f"--backend must be HOST:PORT or unix:PATH, got {backend!r}")
    if not _address_ok(options.listen, port_alone=True):
        raise SettingsError(f"--listen must be PORT, HOST:PORT or unix:PATH, got {options.listen!r}")
    for net in options.metrics_allow:
        try:
            ipaddress.ip_network(net)
        except ValueError:
            raise SettingsError(
                f"--metrics-allow must be an IP address or network such as 10.9.0.0/16, got {net!r}"
            ) from None
    for name, value in (
        ("--prefix", options.prefix),
        ("--access-log", options.access_log),
        ("--error-log", options.error_log),
        ("--user", options.user),
        ("--worker-processes", options.worker_processes),
    ):
        if value is not None and (not value or _UNSAFE.search(value)):
            raise SettingsError(
                f"{name} must not be empty or hold spaces, quotes, braces or ';', got {value!r}"
            )
    if not 1 <= options.upstream_keepalive_timeout_s < keepalive_s:
        raise SettingsError(
            f"--upstream-keepalive-timeout must be from 1 to {keepalive_s - 1} s, below gunicorn's "
            f"keepalive of {keepalive_s} s (gunicorn_conf.py), got {options.upstream_keepalive_timeout_s}: "
            "nginx must close idle connections before gunicorn does, or clients see sporadic 502s"
        )
    for name, number in (
        ("--upstream-keepalive", options.upstream_keepalive),
        ("--max-fails", options.max_fails),
        ("--fail-timeout", options.fail_timeout_s),
        ("--connect-timeout", options.connect_timeout_s),
        ("--next-upstream-tries", 1 if options.next_upstream_tries is None else options.next_upstream_tries),
        ("--max-in-flight", 1 if options.max_in_flight is None else options.max_in_flight),
    ):
        if number < 1:
            raise SettingsError(f"{name} must be a positive integer, got {number}")


def _address_ok(value: str, *, port_alone: bool) -> bool:
    if _UNSAFE.search(value):
        return False
    if value.startswith("unix:"):
        return len(value) > len("unix:")
    host, sep, port = value.rpartition(":")
    if (not sep and not port_alone) or (sep and not host):
        return False
    return port.isdigit() and 0 < int(port) <= 65535


def parse_args(argv: Sequence[str]) -> tuple[Options, str | None]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix", required=True, help="directory for nginx's pid, logs and temp files")
    parser.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="ADDR",
        help="a gunicorn to proxy to, HOST:PORT or unix:PATH; repeat for several hosts (default: SERVE_BIND)",
    )
    parser.add_argument(
        "--listen", default=Options.listen, help="nginx's listen address (default %(default)s)"
    )
    parser.add_argument(
        "--metrics-allow",
        action="append",
        metavar="NET",
        help="an address or network allowed to GET /metrics; repeatable (default: loopback)",
    )
    parser.add_argument("--access-log", help="access log path, or 'off' (default PREFIX/access.log)")
    parser.add_argument("--error-log", help="error log path, or stderr (default PREFIX/error.log)")
    parser.add_argument("--worker-processes", default=Options.worker_processes)
    parser.add_argument("--user", help="user nginx's workers run as when started as root")
    parser.add_argument("--upstream-keepalive", type=int, default=Options.upstream_keepalive)
    parser.add_argument(
        "--upstream-keepalive-timeout",
        type=int,
        default=Options.upstream_keepalive_timeout_s,
        help="seconds an idle upstream connection is kept; below gunicorn's keepalive (default %(default)s)",
    )
    parser.add_argument("--max-fails", type=int, default=Options.max_fails)
    parser.add_argument("--fail-timeout", type=int, default=Options.fail_timeout_s, help="seconds")
    parser.add_argument("--connect-timeout", type=int, default=Options.connect_timeout_s, help="seconds")
    parser.add_argument(
        "--next-upstream-tries", type=int, help="backends one request may try (default: min(backends, 3))"
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        help="requests at each backend at once; past it on every backend nginx answers 503 itself (default: "
        "a full batch per worker and 8 more, the workers as the service plans them on this host)",
    )
    parser.add_argument("-o", "--output", help="write here instead of to stdout")
    args = parser.parse_args(argv)
    options = Options(
        prefix=args.prefix.rstrip("/") or "/",
        backends=tuple(args.backends) if args.backends else (),
        listen=args.listen,
        metrics_allow=tuple(args.metrics_allow) if args.metrics_allow else Options.metrics_allow,
        access_log=args.access_log,
        error_log=args.error_log,
        worker_processes=args.worker_processes,
        user=args.user,
        upstream_keepalive=args.upstream_keepalive,
        upstream_keepalive_timeout_s=args.upstream_keepalive_timeout,
        max_fails=args.max_fails,
        fail_timeout_s=args.fail_timeout,
        connect_timeout_s=args.connect_timeout,
        next_upstream_tries=args.next_upstream_tries,
        max_in_flight=args.max_in_flight,
    )
    return options, args.output


def main(argv: Sequence[str] | None = None) -> int:
    options, output = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = Settings.from_env()
        if not options.backends:
            options = replace(options, backends=(settings.bind,))
        text = render(TEMPLATE.read_text(), options, settings, gunicorn_keepalive())
    except SettingsError as exc:
        print(f"render_nginx: {exc}", file=sys.stderr)
        return 2
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
