"""Open the Locust dashboard (locustfile.py, with its class picker) against a running service.

Waits until the service answers ``/readyz`` (a service started a moment ago may still be
loading its model), prints the dashboard's URL, and then becomes Locust's web UI; Ctrl-C
stops it. Other arguments go to Locust as they are; with ``--headless`` there is no web UI,
and Locust runs the scenario and writes its reports.

    bash scripts/load/dashboard                              # service on 127.0.0.1:8000, UI on :8089
    bash scripts/load/dashboard --host http://127.0.0.1:9000 --web-port 8090
    LOCUST_STEP_SECONDS=10 bash scripts/load/dashboard       # shorter steps for the shapes
    bash scripts/load/dashboard --headless --shape StepLoad --csv reports/step BatchedUser NaiveUser
    bash scripts/load/dashboard --headless --shape IndexingLoad --csv reports/indexing IndexingUser
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import LaunchError, wait_ready  # noqa: E402

DEFAULT_HOST = "http://127.0.0.1:8000"  # scripts/serve's default SERVE_BIND
READY_TIMEOUT_S = 120


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"the service's base URL (default {DEFAULT_HOST})"
    )
    parser.add_argument(
        "--web-host",
        default="127.0.0.1",
        help="address the dashboard listens on (default 127.0.0.1; '*' for every interface)",
    )
    parser.add_argument("--web-port", type=int, default=8089, help="the dashboard's port (default 8089)")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=READY_TIMEOUT_S,
        help=f"seconds to wait for the service's /readyz (default {READY_TIMEOUT_S})",
    )
    args, locust_args = parser.parse_known_args(argv)
    host = args.host.rstrip("/")
    print(f"dashboard: waiting up to {args.ready_timeout:g} s for {host}/readyz", flush=True)
    try:
        wait_ready(host, [], timeout=args.ready_timeout)
    except LaunchError as exc:
        print(
            f"dashboard: no ready service at {host}: {exc}.\n"
            "Start it first with `bash scripts/serve` (in another terminal), or pass --host URL.",
            file=sys.stderr,
        )
        return 1
    command = [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfile.py"), "--host", host]
    if "--headless" in locust_args:
        print(f"Locust, headless: load goes to {host}")
    else:
        shown_host = "127.0.0.1" if args.web_host in ("*", "", "0.0.0.0") else args.web_host
        print(
            f"Locust dashboard: http://{shown_host}:{args.web_port}  (load goes to {host}; Ctrl-C stops it)"
        )
        command += ["--class-picker", "--web-host", args.web_host, "--web-port", str(args.web_port)]
    command += locust_args
    sys.stdout.flush()
    os.chdir(ROOT)
    os.execv(sys.executable, command)  # Locust takes over this process: Ctrl-C and signals reach it


if __name__ == "__main__":
    sys.exit(main())
