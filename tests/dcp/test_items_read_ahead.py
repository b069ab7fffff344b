"""ckptlab.dcp.items.ItemLayouts where every read is a request (a URL): its read-ahead
over item heads, against a counting store, without a server. (Against a real nginx:
``tests/checkpoint/test_remote.py``.)"""

from __future__ import annotations

import random

from ckptlab.dcp import items as dcp_items
from ckptlab.dcp.items import ItemLayouts
from ckptlab.source import RemoteSource, Tree


class _BytesStore:
    """A RemoteStore over bytes in memory: counts requests as the real one does."""

    def __init__(self, data: bytes) -> None:
        from ckptlab.source import RemoteStats

        self.data = data
        self.stats = RemoteStats()

    def head(self, url, n):
        self.stats.add(url, f"bytes=0-{n - 1}", min(n, len(self.data)))
        return len(self.data), self.data[:n]

    def range(self, url, a, b):
        self.stats.add(url, f"bytes={a}-{b - 1}", b - a)
        return self.data[a:b]


class _Tree(Tree):
    """A tree of one file, ``f``, behind a counting store."""

    name = "mem://"

    def __init__(self, store: _BytesStore, window_nbytes: int) -> None:
        self.store = store
        self.window_nbytes = window_nbytes

    def source(self, rel, *, head=None):
        return RemoteSource(self.store, "mem://f", first="head",
                            window_nbytes=self.window_nbytes)


def test_item_reads_behind_a_url_read_ahead_exactly_one_request_per_miss():
    """ItemLayouts' reads over a source whose reads are requests, against a counting store,
    without a server: random item spans, random walks; every read returns the file's bytes,
    a miss costs one request, a fetch one request at most, and the kept bytes stay
    bounded."""

    rng = random.Random(3)
    for trial in range(30):
        sizes = [rng.choice([40, 900, 5000, 70_000, 1_500_000])
                 for _ in range(rng.randrange(1, 40))]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        data = rng.randbytes(sum(sizes) + rng.randrange(0, 100))

        store = _BytesStore(data)
        items = ItemLayouts(_Tree(store, rng.randrange(1, 5000)),
                            {"f": (starts, [s + n for s, n in zip(starts, sizes)])})
        src = items.source("f")
        for _ in range(60):
            i = rng.randrange(len(sizes))
            before = store.stats.requests
            if rng.random() < 0.2:
                a = starts[i] + rng.randrange(sizes[i])
                b = rng.randrange(a, starts[i] + sizes[i] + 1)
                assert src.fetch(a, b) == data[a:b]
            else:
                n = rng.choice([4, 700, 5000])
                off = starts[i]
                assert items.read("f", off, n) == data[off:off + n]
            assert store.stats.requests - before <= 1, trial
            kept = sum(hi - lo for lo, hi in src.kept_ranges())
            assert kept <= dcp_items._KEEP + (1 << 21)
        assert items.read("f", len(data) - 3, 10) == data[-3:]
        assert items.read("f", len(data), 10) == b""
