"""scripts/bench/retrieval.py: its flags, SERVE_MODEL entries, row math, table, and searches against stubs."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from scripts.bench import retrieval as rb

LINES = [f"line {i}" for i in range(10)]


def test_the_defaults_are_8_and_32_users_for_20_seconds_on_minilm() -> None:
    args = rb.parse_args([])
    assert (args.users, args.seconds, args.documents) == ([8, 32], 20.0, 16)
    assert (args.embedder, args.cross_encoder) == ("minilm", None)
    args = rb.parse_args(["--users", "2", "--seconds", "3", "--cross-encoder", "/tmp/ce", "--documents", "4"])
    assert (args.users, args.seconds, args.cross_encoder, args.documents) == ([2], 3.0, Path("/tmp/ce"), 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--users", "0"], "must be at least 1, got 0"),
        (["--users", "8", "x"], "'x' is not a whole number"),
        (["--seconds", "0"], "must be more than 0, got 0"),
        (["--seconds", "soon"], "'soon' is not a number"),
        (["--documents", "-1"], "must be at least 1, got -1"),
    ],
)
def test_flags_refuse_nonsense_saying_why(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        rb.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_serve_model_entry_escapes_what_the_grammar_reserves() -> None:
    assert rb.entry("embed", "minilm") == "embed=minilm"
    assert rb.entry("rerank", "/m/a,b=c\\d") == "rerank=/m/a\\,b\\=c\\\\d"


def test_the_command_line_reruns_the_benchmark_from_the_repository_root() -> None:
    assert rb.command_line(["--users", "8", "32", "--cross-encoder", "/tmp/my dir"]) == (
        ".venv/bin/python scripts/bench/retrieval.py --users 8 32 --cross-encoder '/tmp/my dir'"
    )


def test_a_summary_times_answered_searches_and_counts_what_was_not_200() -> None:
    # 100 searches of 1..100 ms, each step a share of it.
    searches = [(ms / 1000, ms / 4000, 3 * ms / 4000) for ms in range(1, 101)]
    tallies = [
        rb.Tally(searches[:60], Counter({"503": 2})),
        rb.Tally(searches[60:], Counter({"500": 1, rb.NO_ANSWER: 1})),
    ]
    row = rb.summarize(rb.merge(tallies), elapsed_s=4.0)
    assert row["searches"] == 100 and row["searches_per_s"] == 25.0
    # The nearest rank at or above: the 51st of 100 for p50, the 100th for p99.
    assert (row["p50_ms"], row["p99_ms"]) == (51.0, 100.0)
    assert (row["embed_p50_ms"], row["rerank_p50_ms"]) == (12.8, 38.2)
    assert row["not_200"] == 4
    assert row["not_200_by_status"] == {"500": 1, "503": 2, rb.NO_ANSWER: 1}
    assert row["unexpected"] == 1, "a 503 is the service shedding, a lost connection no answer"
    empty = rb.summarize(rb.Tally(), elapsed_s=0.0)
    assert (empty["searches_per_s"], empty["p50_ms"], empty["not_200"]) == (0.0, 0.0, 0)


def _row(setup: str, users: int, searches_per_s: float) -> dict[str, Any]:
    row = rb.summarize(rb.Tally([(0.1, 0.02, 0.08)]), elapsed_s=1.0)
    return {**row, "setup": setup, "users": users, "plan": "2x1", "searches_per_s": searches_per_s}


def test_the_ratio_is_one_service_over_two_services_at_the_same_user_count() -> None:
    rows = rb.with_ratios(
        [_row(rb.ONE, 8, 30.0), _row(rb.ONE, 32, 36.0), _row(rb.TWO, 8, 20.0), _row(rb.TWO, 32, 0.0)]
    )
    assert [(r["setup"], r["users"], r["one_over_two"]) for r in rows] == [
        (rb.ONE, 8, 1.5),
        (rb.ONE, 32, None),  # the two services answered nothing: no ratio
        (rb.TWO, 8, None),
        (rb.TWO, 32, None),
    ]


def test_the_table_puts_each_user_count_s_two_setups_together() -> None:
    rows = rb.with_ratios([_row(rb.ONE, 8, 30.0), _row(rb.ONE, 32, 36.0), _row(rb.TWO, 8, 20.0)])
    rows[2] = {**rows[2], "plan": rb.plan_label([(2, 1), (2, 1)]), "not_200_by_status": {"503": 3}}
    head, rule, *lines = rb.table(rows).splitlines()
    assert head == (
        "| users | setup | workers x threads | searches/s | one / two | p50 | p99 | embed p50 | "
        "rerank p50 | non-200 |"
    )
    assert rule.count("|") == head.count("|")
    assert lines == [
        "| 8 | one service | 2x1 | 30.0 | 1.50x | 100 ms | 100 ms | 20 ms | 80 ms | 0 |",
        "| 8 | two services | 2x1 + 2x1 | 20.0 | - | 100 ms | 100 ms | 20 ms | 80 ms | 503: 3 |",
        "| 32 | one service | 2x1 | 36.0 | - | 100 ms | 100 ms | 20 ms | 80 ms | 0 |",
    ]


class _Stub(BaseHTTPRequestHandler):
    """Answers embeddings and rerank as the service does, or ``status`` for every request."""

    protocol_version = "HTTP/1.1"
    status = 200
    seen: list[tuple[str, dict[str, Any]]]

    def do_POST(self) -> None:
        document = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, document))
        if self.status != 200:
            answer: dict[str, Any] = {"message": "overloaded"}
        elif self.path == rb.EMBED:
            answer = {"data": [{"embedding": [0.5]} for _ in document["input"]]}
        else:
            answer = {"results": [{"index": i} for i in range(len(document["documents"]))]}
        body = json.dumps(answer).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stubs() -> Iterator[list[tuple[str, type[_Stub]]]]:
    """Two stub services, an embedder's and a reranker's: (url, handler class) each."""
    started = []
    for _ in range(2):
        handler = type("Handler", (_Stub,), {"status": 200, "seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append((server, handler))
    yield [(f"http://127.0.0.1:{server.server_address[1]}", handler) for server, handler in started]
    for server, _ in started:
        server.shutdown()
        server.server_close()


def test_users_embed_on_one_port_and_rerank_on_the_other(stubs: list[tuple[str, type[_Stub]]]) -> None:
    (embed_url, embedder), (rerank_url, reranker) = stubs
    tally, elapsed = rb.run_users((embed_url, rerank_url), LINES, users=2, documents=4, seconds=0.5)
    assert elapsed >= 0.5 and len(tally.searches) > 0 and tally.not_200 == Counter()
    assert {path for path, _ in embedder.seen} == {rb.EMBED}
    assert {path for path, _ in reranker.seen} == {rb.RERANK}
    assert len(reranker.seen) == len(tally.searches)
    assert all(body["model"] == "embed" and len(body["input"]) == 1 for _, body in embedder.seen)
    # Two users run at once, so a rerank's query is some embedded query, not
    # necessarily the first one the embedder saw.
    queries = {body["input"][0] for _, body in embedder.seen}
    for _, reranked in reranker.seen:
        assert reranked["model"] == "rerank" and reranked["query"] in queries
        assert len(reranked["documents"]) == 4 and reranked["query"] not in reranked["documents"]
    for whole, embed, rerank in tally.searches:
        assert 0 < embed + rerank <= whole


def test_a_failed_embedding_ends_the_search_and_a_lost_connection_counts_as_no_answer(
    stubs: list[tuple[str, type[_Stub]]],
) -> None:
    (embed_url, embedder), (rerank_url, reranker) = stubs
    embedder.status = 503
    tally = rb.Tally()
    with requests.Session() as session:
        rb.search(session, (embed_url, rerank_url), rb.MODELS, "q", ["a", "b"], tally)
        assert tally.not_200 == Counter({"503": 1}) and tally.searches == []
        assert reranker.seen == [], "no candidates without the query's vector"
        rb.search(session, ("http://127.0.0.1:1", rerank_url), rb.MODELS, "q", ["a"], tally)
    assert tally.not_200 == Counter({"503": 1, rb.NO_ANSWER: 1})
