"""One save's state (``ckptlab.write._state``): when it is pending, how it fails, what its
handle reports."""

from __future__ import annotations

import threading

from ckptlab.errors import WriterError
from ckptlab.write._state import SaveHandle, SaveState, describe


def test_pending_follows_the_save_through_its_steps() -> None:
    save = SaveState("/ckpt", 0, staged=True)
    assert save.pending()  # staged, not yet written
    save.submitted.set()
    assert save.pending()  # buckets in flight
    save.local_done.set()
    assert not save.pending()
    save.commit_thread = threading.Thread(target=lambda: None)
    assert save.pending()  # the commit is running
    save.finished.set()
    assert not save.pending()


def test_fail_keeps_the_real_error_as_the_cause() -> None:
    save = SaveState("/ckpt", 0, staged=False)
    first = OSError(28, "No space left on device")
    err = save.fail(save.message({"rank 0 bucket 1": first, "rank 1": "died"}),
                    {"rank 0 bucket 1": first, "rank 1": "died"})
    assert isinstance(err, WriterError) and save.error is err and err.__cause__ is first
    text = str(err)
    assert text.startswith("async save to /ckpt failed: rank 0 bucket 1: OSError:")
    assert "(and 1 more)" in text and "no .metadata was written" in text
    assert err.failures == {"rank 0 bucket 1": first, "rank 1": "died"}
    assert describe("plain text") == "plain text"


def test_the_handle_reports_progress_and_a_final_timeline() -> None:
    class Writer:
        def _wait_save(self, save: SaveState, timeout: float | None) -> str:
            return f"waited {timeout}"

    save = SaveState("/ckpt", 2, staged=False)
    handle = SaveHandle(save, Writer())
    assert handle.path == "/ckpt" and handle.progress() == (0, 0)
    save.recorder.total_nbytes = 8192
    save.recorder.add(0, "write", save.recorder.now(), 4096, "__2_0.distcp")
    assert handle.progress() == (4096, 8192)
    assert not handle.done() and handle.wait(3) == "waited 3"
    snapshot = handle.timeline
    assert snapshot.nbytes == 4096 and save.timeline is None  # a snapshot is not stored
    save.committed = True
    final = save.freeze()
    save.finished.set()
    assert handle.done() and handle.timeline is final and final.committed and final.rank == 2
    save.is_coordinator = False
    save.local_done.set()
    assert handle.done()
