"""Run nginx in front of the service on this machine: a demo, and what the tests start.

With no --backend it starts the service itself (gunicorn on a unix socket in
nginx's prefix directory); with --backend ADDR (repeatable) it fronts gunicorns
already running, one per host. nginx runs in the foreground with its own prefix
(pid, logs, temp files), so no root and no system nginx setup are needed.
Ctrl-C or SIGTERM stops everything it started. SERVE_* settings apply as usual.

    bash scripts/deploy/serve-behind-nginx               # nginx on 127.0.0.1:8080, gunicorn behind it
    bash scripts/deploy/serve-behind-nginx --backend 127.0.0.2:8000 --backend 127.0.0.3:8000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import LaunchError, free_port, start, stop, wait_ready  # noqa: E402
from scripts.deploy.render_nginx import TEMPLATE, Options, gunicorn_keepalive, render  # noqa: E402
from service.config.settings import Settings  # noqa: E402
from service.errors import SettingsError  # noqa: E402

# Debian installs nginx in /usr/sbin, which is not on an ordinary user's PATH.
NGINX_DIRS = ("/usr/sbin", "/usr/local/sbin", "/usr/local/nginx/sbin")
READY_TIMEOUT_S = 120


def find_nginx(explicit: str | None = None) -> str | None:
    """The nginx binary: ``explicit``, else on PATH, else where distributions put it."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("nginx") or shutil.which("nginx", path=os.pathsep.join(NGINX_DIRS))


def probe_url(listen: str) -> str:
    """A URL on this machine that reaches nginx's ``listen`` address."""
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "*"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


@contextlib.contextmanager
def prefix_dir(given: str | None) -> Iterator[Path]:
    if given:
        path = Path(given).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="serve-nginx-") as tmp:
        # Started as root, nginx's workers run as an unprivileged user and must
        # still reach the temp directories (and socket) inside.
        os.chmod(tmp, 0o755)
        yield Path(tmp)


@contextlib.contextmanager
def fronting(backend_port: int, extra: Sequence[str] = ()) -> Iterator[int]:
    """For the benchmarks: this script's nginx on a free loopback port, in front of the
    service on ``backend_port``, with ``extra`` arguments; the port it listens on."""
    nginx = find_nginx()
    if nginx is None:
        raise SystemExit("nginx not found; install it (apt-get install nginx)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-nginx-") as tmp:
        prefix = Path(tmp)
        prefix.chmod(0o755)  # run as root, nginx's workers are 'nobody' and use temp dirs in here
        command = [sys.executable, str(Path(__file__).resolve()), "--nginx", nginx]
        command += ["--backend", f"127.0.0.1:{backend_port}", "--listen", f"127.0.0.1:{port}"]
        command += ["--prefix", str(prefix), *extra]
        log_path = prefix / "script.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{port}", [process], timeout=60, log_path=log_path)
            yield port
        finally:
            stop(process, grace=20)


def wait_for_stop(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Block until SIGINT or SIGTERM arrives, or one of ``processes`` exits."""
    # Blocked only now, after the children started: a signal mask is inherited
    # across exec, and nginx and gunicorn must keep theirs.
    signals = {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    while all(p.poll() is None for p in processes):
        if signal.sigwait(signals) != signal.SIGCHLD:
            return


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--listen", default="127.0.0.1:8080", help="HOST:PORT for nginx (default %(default)s)"
    )
    parser.add_argument(
        "--backend",
        action="append",
        metavar="ADDR",
        help="a running gunicorn, HOST:PORT or unix:PATH; repeatable",
    )
    parser.add_argument(
        "--metrics-allow", action="append", metavar="NET", help="may GET /metrics (default loopback)"
    )
    parser.add_argument(
        "--worker-processes", default="1", help="nginx worker processes (default %(default)s)"
    )
    parser.add_argument(
        "--prefix", help="nginx's pid, logs and temp files here (default: a temp dir, removed)"
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        help="requests at each backend at once before nginx refuses (default: see render_nginx.py)",
    )
    parser.add_argument("--nginx", help="the nginx binary (default: found on PATH or in /usr/sbin)")
    parser.add_argument(
        "gunicorn_args", nargs="*", help="extra gunicorn options when it starts gunicorn (after --)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM before the children are up unwinds like Ctrl-C, through the cleanup below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    nginx = find_nginx(args.nginx)
    if nginx is None:
        print(
            "serve-behind-nginx: nginx not found; install it (apt-get install nginx) or pass --nginx",
            file=sys.stderr,
        )
        return 2
    with prefix_dir(args.prefix) as prefix:
        backends = tuple(args.backend or (f"unix:{prefix}/gunicorn.sock",))
        options = Options(
            prefix=str(prefix),
            backends=backends,
            listen=args.listen,
            metrics_allow=tuple(args.metrics_allow or Options.metrics_allow),
            worker_processes=args.worker_processes,
            max_in_flight=args.max_in_flight,
        )
        try:
            text = render(TEMPLATE.read_text(), options, Settings.from_env(), gunicorn_keepalive())
        except SettingsError as exc:
            print(f"serve-behind-nginx: {exc}", file=sys.stderr)
            return 2
        conf = prefix / "nginx.conf"
        conf.write_text(text)
        error_log = prefix / "error.log"

        # Children stay in this script's process group: Ctrl-C in a terminal reaches them all.
        gunicorn = None
        if not args.backend:
            gunicorn = start(os.environ, backends[0], args=args.gunicorn_args, new_group=False)
        command = [nginx, "-p", str(prefix), "-c", str(conf), "-e", str(error_log), "-g", "daemon off;"]
        nginx_process = subprocess.Popen(command, cwd=ROOT)
        processes = [p for p in (nginx_process, gunicorn) if p is not None]
        try:
            url = probe_url(args.listen)
            wait_ready(url, processes, timeout=READY_TIMEOUT_S, log_path=error_log)
            print(f"serve-behind-nginx: ready on {url} (nginx config and logs in {prefix})", flush=True)
            wait_for_stop(processes)
        except LaunchError as exc:
            print(f"serve-behind-nginx: {exc}", file=sys.stderr)
            return 1
        finally:
            # nginx first, gracefully (SIGQUIT finishes the requests in flight), then the service.
            stop(nginx_process, signal.SIGQUIT)
            if gunicorn is not None:
                stop(gunicorn, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
