"""Log formats: every line, gunicorn's and the service's, as text or as one JSON object.

gunicorn_conf.py hands :func:`logging_config` to gunicorn, which applies it in
the master before it forks, so the workers inherit it. This module imports
neither torch nor prometheus_client: the master loads it.

Access lines, one per request, are written by a writer thread
(:class:`LineWriter`): a request thread only queues its record. A
``StreamHandler`` would make every request thread take the one handler lock
and write under it, and with dozens of request threads that lock became a
convoy: measured as over a quarter of a worker's Python time on a model that
costs nothing (scripts/bench/overhead.py; docs/bench-request-path.md).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import IO, Any

import orjson

from service.batching import native
from service.host.pid import current_pid

ACCESS_LOGGER = "service.access"

TEXT_FORMAT = "%(asctime)s [%(process)d] [%(levelname)s] [%(name)s] %(message)s"
TEXT_DATE_FORMAT = "[%Y-%m-%d %H:%M:%S %z]"


# relativeCreated of the records made by info_record: from when this module loaded.
_LOADED_NS = time.time_ns()


def info_record(logger: str, msg: str, args: dict[str, Any], **extra: Any) -> logging.LogRecord:
    """An INFO record of ``msg % args``, made without ``LogRecord.__init__``'s lookups.

    That constructor finds the caller's file and module names, the thread's
    name, the process's name and id (a system call) and checks whether the
    args are a mapping, for every record: a quarter of an access line's cost,
    a twentieth of a request's Python time under gevent on a model that costs
    nothing (docs/bench-request-path.md). A line per request needs none of them
    but the pid (service.host.pid keeps it). Every attribute a formatter may
    read is set, the thread's and the process name as None, as with
    ``logging.logThreads`` and ``logging.logMultiprocessing`` off.
    """
    now = time.time_ns()
    record = logging.LogRecord.__new__(logging.LogRecord)
    record.__dict__.update(
        name=logger,
        msg=msg,
        args=args,
        levelname="INFO",
        levelno=logging.INFO,
        pathname="",
        filename="",
        module="",
        exc_info=None,
        exc_text=None,
        stack_info=None,
        lineno=0,
        funcName=None,
        created=now / 1e9,
        msecs=(now % 1_000_000_000) // 1_000_000 + 0.0,
        relativeCreated=(now - _LOADED_NS) / 1e6,
        thread=None,
        threadName=None,
        processName=None,
        process=current_pid(),
        taskName=None,
        **extra,
    )
    return record


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
        # orjson: about half the line's cost of json.dumps (5 against 10 us); a value
        # it cannot write (a numpy scalar) is written as its str, as json.dumps's default was.
        return orjson.dumps(document, default=str).decode()


class LineWriter(logging.Handler):
    """Formats and writes its records in a thread of its own, several lines to a write.

    ``handle`` only queues the record: no lock, no I/O in the caller. The thread
    is a native one (service.batching.native), started in the process that first
    logs through the handler: the handler is made in the gunicorn master and a
    thread does not survive the fork. ``flush`` (called by logging.shutdown at
    exit, and by the worker as it drains) returns once every queued line is out.
    A stream that stops taking lines (a stalled reader) does not hold memory
    without bound: past MAX_QUEUED waiting lines, new ones are dropped, and the
    next write says how many.
    """

    # Lines joined into one write at most; a burst larger than this takes several.
    MAX_LINES_PER_WRITE = 256
    # After a write the thread lets lines gather this long before the next: woken
    # for every line, it would cost each request a thread switch. At a model's
    # pace (a hundred requests a second a worker) 10 ms still meant one wake a
    # line; 50 ms takes about one switch off each request (docs/bench-request-path.md),
    # and a line is still out within a twentieth of a second.
    GATHER_S = 0.05
    # Lines waiting at most. Past this the stream is blocked (a stalled reader of
    # stdout): new lines are dropped and counted rather than held without bound.
    MAX_QUEUED = 10_000

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__()
        self.stream = stream
        self._pid: int | None = None
        self._queue: Any = None
        self._start_lock = native.allocate_lock()
        self._dropped = 0

    def handle(self, record: logging.LogRecord) -> bool:
        if not self.filter(record):
            return False
        if self._pid != current_pid():
            self._start()
        if self._queue.qsize() >= self.MAX_QUEUED:
            self._dropped += 1  # under the GIL; a lost count now and then is no harm
            return False
        self._queue.put(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)

    def flush(self) -> None:
        if self._pid != current_pid():
            return  # nothing was queued in this process
        done = native.allocate_lock()
        done.acquire()
        self._queue.put(done)  # released by the writer once the lines before it are out
        done.acquire(timeout=5)

    def _start(self) -> None:
        with self._start_lock:
            if self._pid == current_pid():
                return
            self._queue = native.SimpleQueue()
            self._pid = current_pid()
            native.start_thread(self._write_forever)

    def _write_forever(self) -> None:
        while True:
            if self._write_waiting(self._queue):
                native.sleep(self.GATHER_S)

    def _write_waiting(self, queue: Any) -> bool:
        """Write the lines waiting in ``queue`` (blocking for one), a write's worth; whether to pause now.

        A full write means more are waiting: no pause, or a fast worker's lines
        would pile up past MAX_QUEUED (256 a pause caps it at 5,120 a second).
        Nor after releasing a flush, whose caller waits for the lines after it.
        """
        batch = [queue.get()]
        while len(batch) < self.MAX_LINES_PER_WRITE:
            try:
                batch.append(queue.get_nowait())
            except native.Empty:
                break
        self._write([item for item in batch if isinstance(item, logging.LogRecord)])
        flushes = [item for item in batch if not isinstance(item, logging.LogRecord)]
        for done in flushes:
            done.release()  # a flush waiting for the lines before it
        return not flushes and len(batch) < self.MAX_LINES_PER_WRITE

    def _write(self, records: list[logging.LogRecord]) -> None:
        lines = []
        dropped, self._dropped = self._dropped, 0
        if dropped:
            lines.append(
                f"{dropped} access lines were dropped: the log stream took more than "
                f"{self.MAX_QUEUED} lines behind\n"
            )
        for record in records:
            try:
                lines.append(self.format(record) + "\n")
            except Exception:
                self.handleError(record)
        if not lines or self.stream is None:
            return
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except Exception:
            self.handleError(records[-1])


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

    def stream(name: str, handler: str = "logging.StreamHandler") -> dict[str, Any]:
        return {"class": handler, "formatter": "serve", "stream": f"ext://sys.{name}"}

    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"serve": formatter},
        # Access lines (stdout) through the writer thread; the rest, rare and
        # wanted at once when a worker is failing, straight to stderr.
        "handlers": {"stderr": stream("stderr"), "stdout": stream("stdout", f"{__name__}.LineWriter")},
        "root": {"level": "INFO", "handlers": ["stderr"]},
        "loggers": {
            # No level: gunicorn has already set the one --log-level asks for.
            # propagate off, or each of its lines would print twice, once via root.
            "gunicorn.error": {"handlers": ["stderr"], "propagate": False},
            ACCESS_LOGGER: {"level": "INFO", "handlers": ["stdout"], "propagate": False},
        },
    }
