"""gunicorn's logger without its access log, whose line the service writes itself.

With ``logconfig_dict`` set, gunicorn counts its access log as enabled and, for
every request, builds the atoms of an access line (headers, times, sizes) for a
logger with no handler: measured as about 4% of a worker's Python time on a
model that costs nothing (scripts/bench/overhead.py). The service's own access line
(service.http.access) carries the request id, route and batch size that
gunicorn's lacks. Errors and gunicorn's other lines log as before, and an
access log asked for on gunicorn's command line (``--access-logfile``) is
written as gunicorn writes it.
"""

from __future__ import annotations

from typing import Any

from gunicorn.glogging import Logger


class NoAccessLogger(Logger):  # type: ignore[misc]  # gunicorn ships no types
    def access(self, resp: Any, req: Any, environ: Any, request_time: Any) -> None:
        if self.cfg.accesslog:
            super().access(resp, req, environ, request_time)
