"""scripts/bench/overhead.py: the free model, the bare app, how samples are told apart, its open-loop load."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson

from scripts.bench import bare_flask
from scripts.bench.overhead import BARE, PARTS, ROUTES, Profile, Run, count_parts, drive, part_of, table
from scripts.bench.overhead import bare_flask as bare_flask_server
from scripts.common.procs import cpu_split_seconds, voluntary_switches
from scripts.fixtures import free_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "request_path.py"


def test_the_free_model_answers_each_text_with_the_same_floats() -> None:
    model = free_model.create()
    out = model.predict(["a", "b", "c"])
    assert out.shape == (3, free_model.DIMENSIONS) and out.dtype == np.float32
    assert (out == free_model.VECTOR).all()
    assert model.predict(["x"] * 2000).shape == (2000, free_model.DIMENSIONS)  # past the rows made once


def test_the_bare_app_answers_as_the_service_does() -> None:
    client = bare_flask.app.test_client()
    answer = client.post("/predict/batched", json={"inputs": ["one", "two"]})
    assert answer.status_code == 200
    assert np.allclose(answer.json["outputs"], [free_model.VECTOR] * 2)


def test_a_sample_goes_to_the_innermost_part_it_passed_through() -> None:
    flask = "Flask.wsgi_app (flask/app.py:1479)"
    finish = "_write_access_line (service/http/access.py:135)"
    inc = "MmapedValue.inc (prometheus_client/values.py:114)"
    assert part_of(["_worker (concurrent/futures/thread.py:83)", flask, finish, inc]) == PARTS[0][0]
    assert part_of(["_worker (concurrent/futures/thread.py:83)", flask, finish]) == "access line (logging)"
    assert part_of(["<module> (x.py:1)"]) == "other"
    # A Future's frames belong to whoever uses it.
    future = ["Future.set_result (concurrent/futures/_base.py:1)", "Condition.notify (threading.py:1)"]
    assert part_of(["Batcher.run (service/batching/batcher.py:1)", *future]) == "batcher and hand-off"
    assert part_of(["ThreadWorker.run (gunicorn/workers/gthread.py:1)", *future]) == PARTS[-1][0]

    lines = [
        f"thread (1): MainThread;{flask};{finish};{inc} 3",
        f"thread (2): T;{flask} 5",
        "garbage line",
    ]
    counted = count_parts(lines)
    assert counted["metrics (prometheus-client)"] == 3 and counted["Flask and werkzeug"] == 5
    assert sum(counted.values()) == 8


def test_samples_become_time_per_request_for_the_sampled_worker() -> None:
    # 200 samples at 200 a second: 1 s of GIL held; 2 workers served 4,000 requests, 2,000 each.
    samples = count_parts(["thread (1): T;Flask.wsgi_app (flask/app.py:1) 200"])
    profile = Profile(samples, seconds=10, requests=4000, workers=2)
    assert profile.us_per_request("Flask and werkzeug") == 500


def test_the_table_gives_each_server_its_cpu_system_share_switches_and_ratios() -> None:
    runs = {
        BARE: [Run(BARE, 1000, 0, 1.0, 0.2, 5.0, sys_s=0.05, switches=2000)],
        "batched": [
            Run("batched", 500, 0, 1.0, 0.2, 9.0, sys_s=0.08, switches=3500),
            Run("batched", 500, 0, 1.0, 0.3, 9.0, sys_s=0.09, switches=3000),
        ],
    }
    lines = table(runs, ["batched"]).splitlines()
    assert lines[2] == "| bare Flask | 0.200 | 25% | 2.0 | 1,000 | 1.00x | 1.00x |"
    # Medians of the two rounds: 0.5 ms a request, 35% in the kernel, 6.5 switches a request.
    assert lines[3] == "| service `/predict/batched` | 0.500 | 35% | 6.5 | 500 | 2.50x | 0.50x |"


def test_a_process_reports_its_cpu_split_and_its_threads_switches() -> None:
    # A process of one thread that spins for 0.1 s of its own CPU (however busy the machine),
    # then sleeps 20 times: each sleep is a voluntary switch, and no thread of it exits
    # (whose count would leave the total with it).
    program = (
        "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.1: pass\n"
        "for _ in range(20): time.sleep(0.005)\ntime.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", program])
    try:
        deadline = time.monotonic() + 10
        while voluntary_switches(child.pid) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert voluntary_switches(child.pid) >= 20
        user, system = cpu_split_seconds(child.pid)
        assert user > 0 and system >= 0  # its spin
    finally:
        child.kill()
        child.wait()
    assert cpu_split_seconds(child.pid) == (0.0, 0.0)  # gone
    assert voluntary_switches(child.pid) == 0


def test_the_in_process_measure_prints_each_route_against_the_bare_app() -> None:
    # scripts/bench/request_path.py end to end, kept short: a real app on the free model,
    # every route answered 200 (the script exits otherwise), a table with a ratio a route.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "40", "--rounds", "1", "--profile", "--top", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| app | us a request | vs bare |"
    assert rows[2].startswith("| bare Flask | ") and rows[2].endswith(" | 1.00x |")
    assert [row.split(" | ")[0] for row in rows[3:]] == [f"| `{path}`" for path, _ in ROUTES.values()]
    assert all(float(row.split(" | ")[2].rstrip("x |")) > 0 for row in rows[3:])
    assert "function calls" in done.stdout  # the profile


def test_with_a_rate_the_load_is_open_loop_arrivals_at_that_pace() -> None:
    # A real gunicorn running the bare app; openloop.py sends on a fixed schedule,
    # so the count is the rate times the time, whatever the server's own speed.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = argparse.Namespace(rate=40.0, clients=64)
    bodies = [orjson.dumps({"inputs": [text]}) for text in ("a short text", "a longer text, still short")]
    with bare_flask_server(env, 1, 4, "gthread") as (url, _):
        result = drive(url + "/predict", bodies, args, 1.0)
    assert result.generator == "openloop"
    assert result.errors == 0
    assert 20 <= result.requests <= 70  # Poisson: about 40
    assert 0 < result.p50_ms <= result.p99_ms
