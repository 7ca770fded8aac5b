"""scripts/bench/batched_clients.py: its request bodies, row math, loads against a stub, and one real run."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from scripts.bench import batched_clients as bc
from scripts.load import openloop
from tests.support.server import ROOT

LINES = [f"line {i}" for i in range(10)]
# A stub's answer to a request body: (status, JSON document).
Answer = Callable[[dict[str, object]], tuple[int, dict[str, object]]]


def test_a_window_is_consecutive_lines_wrapping_around_the_corpus() -> None:
    assert bc.window(LINES, 2, 3) == ["line 2", "line 3", "line 4"]
    assert bc.window(LINES, 8, 4) == ["line 8", "line 9", "line 0", "line 1"]


def test_bodies_take_the_openai_and_cohere_shapes() -> None:
    assert json.loads(bc.embeddings_body("m", ["a", "b"])) == {"model": "m", "input": ["a", "b"]}
    assert json.loads(bc.rerank_body("m", "q", ["a", "b", "c", "d"])) == {
        "model": "m",
        "query": "q",
        "documents": ["a", "b", "c", "d"],
        "top_n": bc.TOP_N,
    }
    # Never more results asked for than there are documents.
    assert json.loads(bc.rerank_body("m", "q", ["a"]))["top_n"] == 1


def test_embeddings_bodies_are_seeded_passages_of_the_asked_size() -> None:
    bodies = bc.embeddings_bodies(LINES, "m", texts=4, count=50)
    assert bodies == bc.embeddings_bodies(LINES, "m", texts=4, count=50)
    for body in bodies:
        texts = json.loads(body)["input"]
        start = LINES.index(texts[0])
        assert texts == bc.window(LINES, start, 4)
    assert len({json.loads(b)["input"][0] for b in bodies}) > 5  # random starts, not one passage


def test_a_rerank_query_is_never_one_of_its_documents() -> None:
    for body in bc.rerank_bodies(LINES, "m", documents=5, count=50):
        document = json.loads(body)
        assert len(document["documents"]) == 5
        assert document["query"] in LINES and document["query"] not in document["documents"]


def test_levels_parse_and_refuse_nonsense() -> None:
    assert bc.clients_list("4,16,64") == [4, 16, 64]
    assert bc.rerank_levels("16x8,100x32") == [(16, 8), (100, 32)]
    for bad in ("", "4,,8", "0", "a"):
        with pytest.raises(argparse.ArgumentTypeError):
            bc.clients_list(bad)
    for bad in ("16", "16x", "x8", "0x8", "16x0", "16*8", "16x8,4"):
        with pytest.raises(argparse.ArgumentTypeError, match="CLIENTSxDOCUMENTS"):
            bc.rerank_levels(bad)


def test_a_summary_counts_items_of_2xx_answers_and_sorts_out_the_rest() -> None:
    answers = [(0.1, 200), (0.2, 200), (0.3, 200), (0.4, 200), (0.001, 503), (0.002, 503), (0.05, 500)]
    row = bc.summarize(bc.Tally(answers, connection_errors=2, elapsed_s=2.0), items_per_request=32)
    assert row["sent"] == 9 and row["requests"] == 4
    assert row["items_per_s"] == 4 * 32 / 2.0
    assert row["refused_503"] == 2 and row["other_non2xx"] == {"500": 1}
    assert row["connection_errors"] == 2
    # Latencies of the 2xx answers alone: the fast refusals do not flatter them.
    assert (row["p50_ms"], row["p99_ms"], row["max_ms"]) == (300.0, 400.0, 400.0)
    empty = bc.summarize(bc.Tally(), items_per_request=32)
    assert empty["items_per_s"] == 0.0 and empty["p50_ms"] == 0.0


def test_ratios_are_against_the_first_level() -> None:
    rows = bc.with_ratios([{"items_per_s": 100.0}, {"items_per_s": 250.0}, {"items_per_s": 50.0}])
    assert [r["vs_first"] for r in rows] == [1.0, 2.5, 0.5]
    assert bc.with_ratios([{"items_per_s": 0.0}, {"items_per_s": 5.0}])[1]["vs_first"] is None


def test_a_probe_keeps_its_latency_from_the_scheduled_send_and_counts_lost_requests() -> None:
    outcomes = [
        openloop.Outcome(0.0, 0.0, 0.5, "200", "valid", False),
        openloop.Outcome(0.2, 0.0, 0.01, "503", "valid", True),
        openloop.Outcome(0.4, 0.0, 60.0, openloop.TIMED_OUT, "valid", False),
    ]
    tally = bc.probe_tally(openloop.Result(rate=5, seconds=1.0, outcomes=outcomes))
    assert tally.answers == [(0.5, 200), (0.01, 503)] and tally.connection_errors == 1


def test_failures_are_named_as_the_caller_sees_them() -> None:
    class StatusError(Exception):
        status_code = 503

    assert bc.failure_name(StatusError()) == "StatusError (503)"
    assert bc.failure_name(ConnectionError()) == "ConnectionError"


def test_bugs_are_answers_neither_2xx_nor_503_in_any_scenario() -> None:
    clean: dict[str, dict[str, int]] = {"other_non2xx": {}}
    results = {
        "embeddings": [clean, {"other_non2xx": {"500": 2}}],
        "rerank": [{"other_non2xx": {"422": 1}}],
        "interactive": {"probe": {"other_non2xx": {"504": 1}}, "bulk": clean},
        "openai": {"failed_non503": {"400": 3}},
    }
    assert bc.bugs(results) == 7
    assert bc.bugs({"embeddings": [clean], "openai": {"failed_non503": {}}}) == 0
    assert bc.unexpected({"200": 5, "201": 1, "503": 4, "504": 1, "connection error": 2}) == {"504": 1}


def test_a_load_row_prints_every_column() -> None:
    row = bc.summarize(bc.Tally([(0.1, 200), (0.01, 503), (0.02, 500)], 1, 1.0), 8)
    table = bc.load_table(bc.with_ratios([{"clients": 16, "items": 8, **row}]), "documents", True)
    head, rule, line = table.splitlines()
    assert head.startswith("| clients | documents a request | requests | documents/s | vs first | 503 |")
    assert rule.count("|") == head.count("|")
    assert line == "| 16 | 8 | 1 | 8 | 1.00x | 1 | 500: 1 | 1 | 100 ms | 100 ms |"


class _Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    answer: Answer

    def do_POST(self) -> None:
        status, document = self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        body = json.dumps(document).encode()
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[Callable[[Answer], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Answer) -> str:
        handler = type("Handler", (_Stub,), {"answer": staticmethod(answer)})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def embeddings(document: dict[str, object]) -> tuple[int, dict[str, object]]:
    texts = document["input"]
    assert isinstance(texts, list)
    data = [{"object": "embedding", "index": i, "embedding": [0.5, 0.5]} for i in range(len(texts))]
    usage = {"prompt_tokens": 1, "total_tokens": 1}
    return 200, {"object": "list", "data": data, "model": document["model"], "usage": usage}


def test_closed_loop_clients_count_every_answer_and_a_probe_runs_beside_them(
    stub: Callable[[Answer], str],
) -> None:
    count = iter(range(10**6))

    def every_third_refused(document: dict[str, object]) -> tuple[int, dict[str, object]]:
        return (503, {}) if next(count) % 3 == 2 else embeddings(document)

    url = stub(every_third_refused)
    row = bc.interactive_scenario(url, "m", LINES, clients=2, texts=4, seconds=1.0, rate=10)
    bulk, probe = row["bulk"], row["probe"]
    assert bulk["requests"] > 0 and bulk["refused_503"] > 0 and bulk["other_non2xx"] == {}
    assert bulk["items_per_s"] > 0 and bulk["connection_errors"] == 0
    # Every probe on the schedule left, and each was answered.
    assert probe["sent"] == len(openloop.schedule(10, 1.0, "poisson", random.Random(0))) > 0
    assert probe["requests"] + probe["refused_503"] == probe["sent"]
    assert bc.bugs({"interactive": row}) == 0
    assert f"| 2 | {probe['sent']} |" in bc.interactive_table(row)


def test_the_openai_sdk_scenario_reports_calls_and_the_exceptions_that_reached_the_caller(
    stub: Callable[[Answer], str],
) -> None:
    row = bc.openai_scenario(stub(embeddings), "m", LINES, threads=2, texts=4, seconds=0.5)
    assert row["succeeded"] > 0 and row["failures"] == {} and row["still_out"] == 0
    assert row["texts_per_s"] > 0

    refused = bc.openai_scenario(stub(lambda _: (400, {})), "m", LINES, threads=1, texts=4, seconds=0.3)
    assert refused["succeeded"] == 0
    assert set(refused["failures"]) == {"BadRequestError (400)"}
    assert bc.bugs({"openai": refused}) == sum(refused["failures"].values()) > 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_script_starts_the_service_and_prints_a_row_per_level(tmp_path: Path) -> None:
    out = tmp_path / "clients.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")} | {"SERVE_WORKERS": "1"}
    command = [sys.executable, "scripts/bench/batched_clients.py", "--embeddings", "2", "--texts", "4"]
    command += ["--seconds", "1", "--json", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| clients | requests | texts/s | vs first | 503 |" in result.stdout
    assert "| 2 | " in result.stdout
    [row] = json.loads(out.read_text())["embeddings"]
    assert row["clients"] == 2 and row["items"] == 4 and row["vs_first"] == 1.0
    assert row["requests"] > 0 and row["items_per_s"] > 0 and row["other_non2xx"] == {}
