"""Waiting on the native batch thread from greenlets, in a gevent-patched process.

Patching is for the life of a process, so the scenario runs in a child Python.
It gates the model with native locks, so each step waits on an event, not a sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.server import ROOT

SCENARIO = r"""
from gevent import monkey
monkey.patch_all()

import json
import gevent
import gevent.event
from service.batching import native
from service.batching.batcher import Batcher
from service.batching.gather import GatherPolicy
from service.errors import DeadlineExceeded
from service.batching.waiting import wait_result

FAR = 1e18
gate = native.allocate_lock()
gate.acquire()
hub_loop = gevent.get_hub().loop
model_entered = gevent.event.Event()

def predict(batch):
    hub_loop.run_callback_threadsafe(model_entered.set)
    gate.acquire(timeout=20)  # the main greenlet opens it
    return [x * 2 for x in batch]

def wait_for_the_model():
    assert model_entered.wait(10), "the batch thread never called the model"
    model_entered.clear()

batcher = Batcher(predict, max_batch_size=1, queue_limit=10, policy=GatherPolicy(adaptive=False))
batcher.start()
report = {}

# 1. A greenlet waits for a running batch; the hub stays free; the batch thread wakes it.
pending = batcher.submit([1], FAR)
report["native_lock"] = type(pending.future._ready) is type(gate)  # native, as the gate
waiter = gevent.spawn(wait_result, pending.future, 20)
wait_for_the_model()
ticks = 0
for _ in range(5):
    gevent.sleep(0)  # the main greenlet keeps running while the waiter waits
    ticks += 1
report["waiting_while_hub_runs"] = not waiter.ready() and ticks == 5
gate.release()
report["result"] = list(waiter.get(timeout=10))

# 2. A deadline while the batch runs: DeadlineExceeded; the batch's late result goes nowhere.
running = batcher.submit([2], FAR)
queued = batcher.submit([3], FAR)
wait_for_the_model()
for name, request, timeout in (("running", running, 0.05), ("queued", queued, 0.05)):
    try:
        wait_result(request.future, timeout)
        report[name] = "answered"
    except DeadlineExceeded:
        report[name] = "deadline"
report["queued_cancelled"] = queued.future.cancelled()
gate.release()
report["running_result_after_deadline"] = list(running.future.result(timeout=10))

# 3. An already finished future returns at once.
report["done_before_wait"] = list(wait_result(running.future, 0))
report["stopped"] = batcher.stop(timeout=10)
print(json.dumps(report))
"""


def test_greenlets_wait_for_the_native_batch_thread_through_the_hub() -> None:
    report = run_scenario(SCENARIO)
    assert report == {
        "native_lock": True,
        "waiting_while_hub_runs": True,
        "result": [2],
        "running": "deadline",
        "queued": "deadline",
        "queued_cancelled": True,
        "running_result_after_deadline": [4],
        "done_before_wait": [4],
        "stopped": True,
    }


BURST = r"""
from gevent import monkey
monkey.patch_all()

import json
import gevent
from service.batching import native, waiting
from service.batching.batcher import Batcher
from service.batching.gather import GatherPolicy
from service.batching.waiting import wait_result

waiting.HUB_TURN_WAIT_S = 5.0  # the mechanism, not the cap: a slow machine must not cut the turn short
sizes = []

def predict(batch):
    sizes.append(len(batch))
    return [x * 2 for x in batch]

batcher = Batcher(predict, max_batch_size=16, queue_limit=64, policy=GatherPolicy(adaptive=False))
batcher.start()

def client(i):
    # A request greenlet makes socket calls before it queues its request, and
    # each releases the GIL; a native sleep does too, blocking the hub as briefly.
    native.sleep(0.0002)
    return list(wait_result(batcher.submit([i], 1e18).future, 10))

gevent.spawn(client, 100).get(timeout=10)  # the first greenlet to wait shows the batch thread the hub
sizes.clear()
native.sleep(0.05)  # blocks the hub, so the batch thread is waiting on an empty queue again
burst = [gevent.spawn(client, i) for i in range(8)]  # all woken in one turn of the hub
results = [g.get(timeout=10) for g in burst]
print(json.dumps({"results": results, "sizes": sizes, "stopped": batcher.stop(timeout=10)}))
"""


def test_requests_queued_in_one_turn_of_the_hub_make_one_batch() -> None:
    # Without waiting for the hub's turn, the batch thread took the GIL at the
    # first greenlet's socket call after the first request was queued, and ran
    # that request alone: under load, a batch and two GIL round trips a request.
    report = run_scenario(BURST)
    assert report == {"results": [[2 * i] for i in range(8)], "sizes": [8], "stopped": True}


LONE = r"""
from gevent import monkey
monkey.patch_all()

import json
import gevent
from service.batching import waiting
from service.batching.batcher import Batcher
from service.batching.waiting import wait_result

thread_id = monkey.get_original("_thread", "get_ident")  # the OS thread's, not the greenlet's
threads = []

def predict(batch):
    threads.append(thread_id())
    return [x * 2 for x in batch]

# Any call counts as cheap and any gap as quiet: the scenario is the greenlet's, not the timing's.
batcher = Batcher(predict, max_batch_size=8, queue_limit=10, run_here_below_s=60.0, run_here_after_s=0.0)
batcher.start()
first = list(wait_result(batcher.submit([1], 1e18).future, 10))  # timed by the batch thread
waiting._hub_loop = None  # set by that wait; a waiter made from here on sets it again

def lone():
    with batcher.in_flight():
        return list(wait_result(batcher.submit([2], 1e18).future, 10))

answer = gevent.spawn(lone).get(timeout=10)
print(json.dumps({
    "answers": [first, answer],
    # The second call ran on the hub's thread, in the request's greenlet.
    "ran_here": threads[1] == thread_id() != threads[0],
    # Answered within submit(): no waiter asked the hub to wake it.
    "hub_asked": waiting._hub_loop is not None,
    "stopped": batcher.stop(timeout=10),
}))
"""


def test_a_lone_greenlet_runs_its_cheap_call_itself_and_never_waits_on_the_hub() -> None:
    report = run_scenario(LONE)
    assert report == {"answers": [[2], [4]], "ran_here": True, "hub_asked": False, "stopped": True}


ON_HUB = r"""
from gevent import monkey
monkey.patch_all()

import json
import gevent
from service.batching import native
from service.batching.batcher import Batcher
from service.batching.gather import GatherPolicy
from service.batching.waiting import wait_result

thread_id = monkey.get_original("_thread", "get_ident")  # the OS thread's, not the greenlet's
hub_thread = thread_id()
calls = []  # (the batch, whether it ran on the hub's thread)
gate = native.allocate_lock()
gate.acquire()

def predict(batch):
    calls.append((list(batch), thread_id() == hub_thread))
    if batch[0] < 0:
        gate.acquire(timeout=20)  # a call the batch thread is in the middle of
    return [x * 2 for x in batch]

# Any call counts as cheap; no request is alone (in_flight is not used), so none runs in its own greenlet.
batcher = Batcher(
    predict, max_batch_size=16, queue_limit=64, policy=GatherPolicy(adaptive=False), run_here_below_s=60.0
)
batcher.start()

def client(i):
    return list(wait_result(batcher.submit([i], 1e18).future, 10))

report = {"first": gevent.spawn(client, 100).get(timeout=10)}  # timed by the batch thread; it shows the hub
# 1. A turn's requests: one batch, run on the hub's thread after the turn.
burst = [gevent.spawn(client, i) for i in range(8)]
report["burst"] = [g.get(timeout=10) for g in burst]

# 2. While the batch thread holds the runner (a call of a request sent from another OS thread),
# a turn's requests are handed to it.
outside = []
native.start_thread(lambda: outside.append(list(batcher.submit([-1], 1e18).future.result(timeout=20))))
while len(calls) < 3:
    gevent.sleep(0.001)  # until the batch thread is in that call
late = [gevent.spawn(client, i) for i in (20, 21, 22)]
while batcher.depth < 3 or batcher._hub_run_due:
    gevent.sleep(0)  # until the run for the hub found the runner taken
gate.release()
report["late"] = [g.get(timeout=10) for g in late]
while not outside:
    gevent.sleep(0.001)
report["outside"] = outside[0]
report["calls"] = calls
report["stopped"] = batcher.stop(timeout=10)
print(json.dumps(report))
"""


def test_a_turns_requests_to_a_cheap_model_run_as_one_batch_on_the_hubs_thread() -> None:
    report = run_scenario(ON_HUB)
    assert report == {
        "first": [200],
        "burst": [[2 * i] for i in range(8)],
        "late": [[40], [42], [44]],
        "outside": [-2],
        "calls": [
            [[100], False],  # the batch thread's, before the model was timed
            [list(range(8)), True],  # the turn's eight, on the hub's thread
            [[-1], False],
            [[20, 21, 22], False],  # queued while the batch thread ran: its to run
        ],
        "stopped": True,
    }


def run_scenario(code: str) -> dict[str, object]:
    """Run ``code`` in a child Python (gevent patches a process for good); the JSON its last line prints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report
