"""RemoteSource without a server: its kept bytes against a reference, its requests counted.

(The requests against a real nginx, counted in its access log, are
``tests/checkpoint/test_remote.py``'s.)"""

from __future__ import annotations

import random


def test_kept_ranges_merge_and_serve_reads():
    """RemoteSource's keeping of moved bytes, against a reference, without a server."""
    from ckptlab.source._remote import RemoteSource, _missing

    data = bytes(random.Random(0).randbytes(5000))

    class Store:  # counts ranges like RemoteStore
        class stats:
            requests = 0
            bytes_moved = 0

        def tail(self, url, n):
            Store.stats.requests += 1
            return len(data), len(data) - n, data[-n:]

        def range(self, url, a, b):
            Store.stats.requests += 1
            Store.stats.bytes_moved += b - a
            return data[a:b]

    rng = random.Random(1)
    src = RemoteSource(Store(), "mem://x", window_nbytes=100)
    for _ in range(300):
        a = rng.randrange(0, 5000)
        n = rng.randrange(0, 5000 - a + 1)
        before = src.kept_ranges()
        assert src.read(a, n) == data[a:a + n]
        missing = _missing(before, a, a + n)
        assert src.reads == Store.stats.requests
        kept = src.kept_ranges()
        assert all(kept[i][1] < kept[i + 1][0] for i in range(len(kept) - 1))  # disjoint
        assert all(src.kept(lo, hi - lo) == data[lo:hi] for lo, hi in kept)
        assert all(any(lo <= x and y <= hi for lo, hi in kept) for x, y in missing)
