"""Bounded call shapes: a text model's batches padded to a few sizes, so oneDNN finds its kernels again.

oneDNN, which runs bfloat16's matrix products on a CPU (AMX or avx512_bf16),
builds a kernel ("primitive") for each whole shape it is called with and keeps
it in a cache. Text batches of mixed length have a new shape at nearly every
call: with the cache off every call builds its kernels again, and bfloat16 runs
slower than float32; with it on, the cache fills with shapes seen once and the
worker grows (a MiniLM worker from 0.9 to 3.7 GiB in six minutes). So where the
worker's oneDNN cache is on, a call's rows are padded up to the next of a few
steps (powers of two, up to SERVE_MAX_BATCH_SIZE) and its length up to the
next of a few steps: multiples of 16 tokens (an AMX tile's rows) up to 64,
then two a doubling (96, 128, 192, 256, ...), never past the model's longest
input. MiniLM at 64 rows, 256 tokens and the 8,192-token budget then has 54
shapes: about 160 primitives, which oneDNN's default cache of 1024 holds
(docs/memory.md). Why so few past 64 tokens: a worker's memory grows the
first time traffic reaches a shape (its kernels, and the heap its activations
leave behind), and the rare shapes (many rows of long text) are reached last,
minutes into a run; fewer of them are all reached sooner. Pure: no torch.

The batcher's cost model reads the same shapes (service.batching.subbatch), so
its cuts fall on the steps rather than one row past them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache

# AMX multiplies tiles of 16 rows; a length a multiple of it wastes none of a tile.
LENGTH_MULTIPLE = 16
# Up to here lengths step by LENGTH_MULTIPLE; past it, by two steps a doubling
# (at most a third of a call's tokens padding, where one step of 16 would cost
# twice the shapes for long text).
FINE_LENGTHS = 64


# Asked for every range the batcher weighs before a batch (service.batching.subbatch.cut).
@lru_cache(maxsize=4096)
def padded_length(longest: int, multiple: int = LENGTH_MULTIPLE, fine: int = FINE_LENGTHS) -> int:
    """The length a call whose longest input has ``longest`` tokens is padded to (no model limit)."""
    if longest <= fine:
        return max(multiple, -(-longest // multiple) * multiple)
    octave = fine
    while octave * 2 < longest:
        octave *= 2
    # Between octave and 2 * octave: the middle step, or the doubling.
    middle = octave + octave // 2
    return middle if longest <= middle else octave * 2


@dataclass(frozen=True)
class ShapeSteps:
    """The row counts a call is padded up to, and the steps of its length (``padded_length``)."""

    rows: tuple[int, ...]
    multiple: int = LENGTH_MULTIPLE
    # The model's longest input in tokens: a length is never padded past it.
    limit: int | None = None
    fine: int = FINE_LENGTHS

    def shape(self, rows: int, longest: int) -> tuple[int, int]:
        """The padded ``(rows, length)`` a call of ``rows`` items, the longest ``longest``, runs as."""
        step = bisect_left(self.rows, rows)
        padded_rows = self.rows[step] if step < len(self.rows) else rows
        length = padded_length(longest, self.multiple, self.fine)
        if self.limit is not None:
            length = min(length, max(longest, self.limit))
        return padded_rows, length

    def tokens(self, rows: int, longest: int) -> int:
        padded_rows, length = self.shape(rows, longest)
        return padded_rows * length


def steps_for(max_rows: int, limit: int | None, multiple: int = LENGTH_MULTIPLE) -> ShapeSteps:
    """Powers of two below ``max_rows``, then ``max_rows`` itself: at most twice the rows, log2 steps."""
    rows, step = [], 1
    while step < max_rows:
        rows.append(step)
        step *= 2
    rows.append(max_rows)
    return ShapeSteps(tuple(rows), multiple=multiple, limit=limit)
