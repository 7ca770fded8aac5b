"""Log formats: every line, gunicorn's and the service's, as text or as one JSON object.

gunicorn_conf.py hands :func:`logging_config` to gunicorn, which applies it in
the master before it forks, so the workers inherit it. This module imports
neither torch nor prometheus_client: the master loads it.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

ACCESS_LOGGER = "service.access"

TEXT_FORMAT = "%(asctime)s [%(process)d] [%(levelname)s] [%(name)s] %(message)s"
TEXT_DATE_FORMAT = "[%Y-%m-%d %H:%M:%S %z]"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; an access line adds its fields (``extra={"fields": {...}}``)."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            document.update(fields)
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def logging_config(log_format: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` document for ``SERVE_LOG_FORMAT`` (``text`` or ``json``).

    Access lines go to stdout and everything else to stderr, the streams
    gunicorn uses for its access and error logs.
    """
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"}
        if log_format == "json"
        else {"format": TEXT_FORMAT, "datefmt": TEXT_DATE_FORMAT}
    )

    def stream(name: str) -> dict[str, Any]:
        return {"class": "logging.StreamHandler", "formatter": "serve", "stream": f"ext://sys.{name}"}

    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"serve": formatter},
        "handlers": {"stderr": stream("stderr"), "stdout": stream("stdout")},
        "root": {"level": "INFO", "handlers": ["stderr"]},
        "loggers": {
            # No level: gunicorn has already set the one --log-level asks for.
            # propagate off, or each of its lines would print twice, once via root.
            "gunicorn.error": {"handlers": ["stderr"], "propagate": False},
            ACCESS_LOGGER: {"level": "INFO", "handlers": ["stdout"], "propagate": False},
        },
    }
