"""Start nginx in front of running gunicorns through scripts/deploy/serve_behind_nginx.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.common.launcher import ROOT, free_port, stop, wait_ready
from scripts.deploy.serve_behind_nginx import find_nginx

NGINX = find_nginx()
SKIP_REASON = "nginx not found on PATH or in /usr/sbin: install Debian's nginx package (.ci/run does)"


@dataclass
class Proxy:
    url: str
    prefix: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def access_log(self) -> list[dict[str, object]]:
        """nginx's access log so far, one JSON object per request.

        nginx writes a request's line once it is done with the request, which
        can be after the client has read the response: a 413's line comes only
        when the client has closed the connection. Wait for a line rather than
        read the log once. A line nginx is writing at this moment is left out.
        """
        text = (self.prefix / "access.log").read_text()
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


@contextlib.contextmanager
def nginx(
    backends: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    metrics_allow: Sequence[str] = (),
    max_in_flight: int | None = None,
    ready_timeout: float = 30,
) -> Iterator[Proxy]:
    """nginx on a free loopback port in front of ``backends``, with SERVE_* limits from ``env``."""
    assert NGINX is not None, SKIP_REASON
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    full_env.update(env or {})
    command = [sys.executable, "scripts/deploy/serve_behind_nginx.py", "--nginx", NGINX]
    command += ["--listen", f"127.0.0.1:{port}"]
    for backend in backends:
        command += ["--backend", backend]
    for net in metrics_allow:
        command += ["--metrics-allow", net]
    if max_in_flight is not None:
        command += ["--max-in-flight", str(max_in_flight)]
    with tempfile.TemporaryDirectory(prefix="nginx-test-") as tmp:
        prefix = Path(tmp)
        # Run as root, nginx's workers are 'nobody' and must reach their temp dirs in here.
        prefix.chmod(0o755)
        log_path = prefix / "script.log"
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [*command, "--prefix", str(prefix)],
                cwd=ROOT,
                env=full_env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, [process], timeout=ready_timeout, log_path=log_path)
            yield Proxy(url, prefix, process, log_path)
        finally:
            stop(process, grace=20)
