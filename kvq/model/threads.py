"""Small torch work on one thread.

Every `kvq` command runs with `OMP_WAIT_POLICY=PASSIVE` (docs/settings.md): an OpenMP thread
sleeps between parallel regions, so each region torch opens pays a futex wake. For a decode
step's per-sequence attention (a few KB of queries against one sequence's cache) that wake
is most of the cost: 8 sequences' attention of one olmoe layer took 1.5 ms on 2 threads and
0.3 ms on one (`tests/model/test_threads.py` checks the behaviour, `kvq bench model` the
speed). The same holds for a decode step's norms, rope and routing (a 512-value `cos` took
66 us on 2 threads, 1.6 on one; the router's [8, 2048] x [2048, 64] product 219 us against
41). The forward pass puts those in the block (`small_block`, up to `SMALL_ROWS` rows); the
weight products before and after keep every thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

_local = threading.local()  # torch's thread count is per thread (OpenMP's), so is the saving
# the small torch work of a pass (norms, rope, routing, each sequence's attention) runs on one
# thread when it has at most this many rows (decode steps, short prompts): its parallel regions
# cost more in wake-ups than they save. The attention projections, the output head and the
# experts run outside these blocks and keep every thread.
SMALL_ROWS = 64


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's torch ops (in this thread) on one thread, then restore this thread's
    count; a nested block leaves the restoring to the outermost one."""
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.saved = torch.get_num_threads()
        if _local.saved > 1:
            torch.set_num_threads(1)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if _local.depth == 0 and _local.saved > 1:
            torch.set_num_threads(_local.saved)


def small_block(rows: int) -> Callable[[], AbstractContextManager[None]]:
    """The block for torch work over `rows` rows: `one_thread` up to `SMALL_ROWS`, else none."""
    return one_thread if rows <= SMALL_ROWS else nullcontext
