"""Request ids, the access log line and the log formats, in process."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import numpy as np
import pytest
from flask.testing import FlaskClient

from service.batching import native
from service.config.settings import Settings
from service.http.access import REQUEST_ID_HEADER, request_id
from service.telemetry.logs import (
    ACCESS_LOGGER,
    TEXT_DATE_FORMAT,
    TEXT_FORMAT,
    JsonFormatter,
    LineWriter,
    info_record,
    logging_config,
)

VECTOR = [0.1 * i for i in range(16)]


@pytest.mark.parametrize("given", ["3f2a9c0e-1b7d-4e5f-8a6b-0c1d2e3f4a5b", "a" * 128, "trace:1/span=2+x_y.z"])
def test_a_sane_request_id_is_echoed(client: FlaskClient, given: str) -> None:
    response = client.get("/healthz", headers={REQUEST_ID_HEADER: given})
    assert response.headers[REQUEST_ID_HEADER] == given


@pytest.mark.parametrize("given", ["", "a" * 129, "two words", 'quote"d', "tab\there", "naïve", "<script>"])
def test_an_insane_request_id_is_replaced(given: str) -> None:
    fresh = request_id(given)
    assert fresh != given
    assert len(fresh) == 32 and int(fresh, 16) >= 0


def test_the_client_gets_the_replacement_id(client: FlaskClient) -> None:
    sent = "x" * 500
    response = client.get("/healthz", headers={REQUEST_ID_HEADER: sent})
    assert len(response.headers[REQUEST_ID_HEADER]) == 32


def test_every_response_gets_a_new_id_when_none_was_sent(client: FlaskClient) -> None:
    ids = {client.get(path).headers[REQUEST_ID_HEADER] for path in ("/healthz", "/healthz", "/nope")}
    assert len(ids) == 3
    # Error responses carry one too, including a refusal before the route runs.
    refused = client.post("/predict/batched", data=b"x", content_type="text/plain")
    assert refused.status_code == 415 and refused.headers[REQUEST_ID_HEADER]


def test_a_request_refused_by_the_token_check_still_gets_an_id_and_a_line(
    make_client: Callable[[Settings], FlaskClient], caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(Settings(model="mlp", mlp_width=16, mlp_depth=1, api_token="s3cret"))
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    response = client.post("/predict", json={"inputs": [VECTOR]}, headers={REQUEST_ID_HEADER: "no-token-1"})
    assert response.status_code == 401
    assert response.headers[REQUEST_ID_HEADER] == "no-token-1"
    lines = [r.fields for r in caplog.records if r.name == ACCESS_LOGGER]  # type: ignore[attr-defined]
    assert [(f["request_id"], f["status"]) for f in lines] == [("no-token-1", 401)]


def test_one_access_line_per_request_with_id_route_status_latency_and_batch_size(
    client: FlaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    client.post("/predict/batched", json={"inputs": [VECTOR, VECTOR]}, headers={REQUEST_ID_HEADER: "req-7"})
    client.get("/no/such\npath")
    first, second = [r for r in caplog.records if r.name == ACCESS_LOGGER]

    fields = first.fields  # type: ignore[attr-defined]
    assert fields["request_id"] == "req-7"
    assert (fields["method"], fields["route"], fields["status"], fields["batch_size"]) == (
        "POST",
        "/predict/batched",
        200,
        2,
    )
    assert fields["duration_ms"] > 0
    line = first.getMessage()
    parts = (
        '"POST /predict/batched" 200',
        "route=/predict/batched",
        "model=mlp",
        "batch_size=2",
        "request_id=req-7",
    )
    for part in parts:
        assert part in line

    # A path that matched nothing is logged as one token: no forged second line.
    assert second.fields["route"] == "unmatched" and second.fields["batch_size"] is None  # type: ignore[attr-defined]
    assert "\n" not in second.getMessage() and "batch_size=-" in second.getMessage()
    assert second.fields["model"] is None and "model=-" in second.getMessage()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sent", "path", "route", "status"),
    [
        # The raw WSGI path (latin-1 by the WSGI rules), decoded as werkzeug decodes it.
        ("/caf%C3%A9/na%C3%AFve", "/café/naïve", "unmatched", 404),
        # A route with a variable is labelled by its rule, the path logged as sent.
        ("/v2/models/mlp", "/v2/models/mlp", "/v2/models/<name>", 200),
    ],
)
def test_the_line_shows_the_decoded_path_and_the_rule_it_matched(
    client: FlaskClient, caplog: pytest.LogCaptureFixture, sent: str, path: str, route: str, status: int
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    client.get(sent)
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    fields = record.fields  # type: ignore[attr-defined]
    assert (fields["path"], fields["route"], fields["status"]) == (path, route, status)


def test_json_lines_carry_the_access_fields(client: FlaskClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    client.post("/predict/naive", json={"inputs": [VECTOR]}, headers={REQUEST_ID_HEADER: "json-1"})
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    document = json.loads(JsonFormatter().format(record))
    assert document["logger"] == ACCESS_LOGGER and document["level"] == "INFO"
    assert document["request_id"] == "json-1"
    assert (document["route"], document["status"], document["batch_size"]) == ("/predict/naive", 200, 1)
    assert document["time"].endswith("+00:00")


def test_an_info_record_formats_as_the_logger_s_own_record_would() -> None:
    line = "%(remote)s %(status)d"
    args = {"remote": "127.0.0.1", "status": 200}
    extra = {"fields": {"status": 200}}
    made = info_record(ACCESS_LOGGER, line, args, **extra)
    logger = logging.getLogger(ACCESS_LOGGER)
    own = logger.makeRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, line, (args,), None, extra=extra)
    assert made.created == pytest.approx(own.created, abs=5)
    made.created, made.msecs = own.created, own.msecs  # the same instant, for the formatted time
    for formatter in (logging.Formatter(TEXT_FORMAT, TEXT_DATE_FORMAT), JsonFormatter()):
        assert formatter.format(made) == formatter.format(own)
    assert made.process == os.getpid()
    assert made.getMessage() == "127.0.0.1 200"


def test_json_lines_carry_exceptions() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        record = logging.LogRecord(
            "service.x", logging.ERROR, __file__, 1, "failed %s", ("x",), sys.exc_info()
        )
    document = json.loads(JsonFormatter().format(record))
    assert document["message"] == "failed x"
    assert "ValueError: bad" in document["exception"]


def test_json_lines_write_a_value_json_has_no_type_for_as_its_text() -> None:
    record = info_record(ACCESS_LOGGER, "line", {}, fields={"count": np.int64(3), "ratio": np.float32(0.5)})
    document = json.loads(JsonFormatter().format(record))
    assert (document["count"], document["ratio"]) == ("3", "0.5")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_logging_config_routes_access_lines_to_stdout_and_the_rest_to_stderr(log_format: str) -> None:
    # In a child process: applying a logging config here would rewire the test run's own logging.
    program = textwrap.dedent(
        f"""
        import logging, logging.config
        from service.telemetry.logs import logging_config
        logging.config.dictConfig(logging_config({log_format!r}))
        logging.getLogger("service.access").info("the access line")
        logging.getLogger("service.runtime").info("a service line")
        logging.getLogger("gunicorn.error").warning("a gunicorn line")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.count("\n") == 1 and "the access line" in done.stdout
    assert "a service line" in done.stderr and "a gunicorn line" in done.stderr
    assert done.stderr.count("a gunicorn line") == 1  # not printed again through the root logger
    if log_format == "json":
        for line in (done.stdout + done.stderr).splitlines():
            json.loads(line)


def test_logging_config_is_a_valid_document() -> None:
    config = logging_config("json")
    assert config["formatters"]["serve"] == {"()": "service.telemetry.logs.JsonFormatter"}
    assert "gunicorn.access" not in config["loggers"]  # left to gunicorn, whose access log stays off


def test_access_lines_from_many_threads_and_a_forked_child_all_come_out_whole() -> None:
    # The writer thread is started in the process that logs, after a fork too, and
    # what it has queued is out by the time the process exits.
    program = textwrap.dedent(
        """
        import logging, logging.config, os, sys, threading
        from service.telemetry.logs import logging_config
        logging.config.dictConfig(logging_config("text"))
        access = logging.getLogger("service.access")
        access.info("before the fork")
        logging.getLogger("service.access").handlers[0].flush()
        child = os.fork()
        who = "child" if child == 0 else "parent"
        threads = [
            threading.Thread(target=lambda t=t: [access.info("%s %d %d", who, t, i) for i in range(500)])
            for t in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if child == 0:
            sys.exit(0)
        os.waitpid(child, 0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stdout.splitlines()
    assert sum("before the fork" in line for line in lines) == 1
    for who in ("parent", "child"):
        for t in range(8):
            numbers = [int(line.rsplit(" ", 1)[1]) for line in lines if f"] {who} {t} " in line]
            assert numbers == list(range(500)), (who, t, numbers[:5])


def test_a_blocked_log_stream_holds_a_bounded_number_of_lines_and_says_how_many_it_dropped() -> None:
    class Stalled(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.entered = threading.Event()
            self.opened = threading.Event()

        def write(self, text: str) -> int:
            self.entered.set()
            self.opened.wait(10)  # a reader that stopped reading
            return super().write(text)

    stream = Stalled()
    writer = LineWriter(stream)
    writer.MAX_QUEUED = 5
    writer.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("test.stalled")
    log.propagate = False
    log.addHandler(writer)
    try:
        log.warning("first")  # taken by the writer thread, which then blocks writing it
        assert stream.entered.wait(10)
        for i in range(50):
            log.warning("line %d", i)
        assert writer._queue.qsize() <= 5
        stream.opened.set()
        writer.flush()
        log.warning("after")
        writer.flush()
    finally:
        log.removeHandler(writer)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "first" and lines[-1] == "after"
    assert [line for line in lines if line.startswith("line ")] == [f"line {i}" for i in range(5)]
    assert any(line.startswith("45 access lines were dropped") for line in lines), lines


def test_a_full_write_is_followed_at_once_by_the_next_and_a_short_one_by_the_pause() -> None:
    # At most MAX_LINES_PER_WRITE lines a write; a full one means more are waiting,
    # and a pause after it would cap the lines a second a worker can log.
    stream = io.StringIO()
    writer = LineWriter(stream)
    writer.MAX_LINES_PER_WRITE = 4
    writer.setFormatter(logging.Formatter("%(message)s"))
    queue = native.SimpleQueue()
    for i in range(10):
        queue.put(logging.LogRecord("access", logging.INFO, __file__, 1, "line %d", (i,), None))
    pauses = [writer._write_waiting(queue) for _ in range(3)]
    assert pauses == [False, False, True]  # 4 and 4 lines: on at once; 2: gather for the next
    assert stream.getvalue().splitlines() == [f"line {i}" for i in range(10)]


def test_a_fault_recording_the_metrics_does_not_fail_the_answer(
    client: FlaskClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As a metrics file on a full disk would: the answer is made, and still goes out, with its id.
    from service.telemetry.metrics import EXTENSION as METRICS

    metrics = client.application.extensions[METRICS]

    def broken(*_: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(metrics, "observe_request", broken)
    monkeypatch.setattr(metrics, "request_finished", broken)
    response = client.get("/healthz", headers={REQUEST_ID_HEADER: "disk-full-1"})
    assert response.status_code == 200 and response.headers[REQUEST_ID_HEADER] == "disk-full-1"
    assert "recording request disk-full-1 failed" in caplog.text
