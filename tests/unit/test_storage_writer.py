"""ResultWriter on local disk: blocks, row order, resume from commit markers, manifest last, retries."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from contracts import storage
from contracts.layout import ResultLayout
from worker.storage import ResultWriteError, ResultWriter, RetryPolicy

FAST = RetryPolicy(attempts=3, first_delay_s=0.001)


def rows_of(J: np.ndarray, layout: ResultLayout) -> np.ndarray:
    """The reference rows of ``J``: iterated axes first (C order), then the rest in array order."""
    it = list(range(layout.iter_start, layout.iter_stop))
    rest = [a for a in range(J.ndim) if a not in it]
    return np.transpose(J, it + rest).reshape((layout.rows_total,) + layout.row_shape)


def feed(writer: ResultWriter, rows: np.ndarray, sizes: list[int], start: int = 0) -> None:
    pos = start
    for n in sizes:
        writer.write_rows(pos, rows[pos - start:pos - start + n])
        pos += n


@pytest.fixture
def layout() -> ResultLayout:
    # 6 rows of 5 float32 -> 20 bytes per row; 40-byte blocks -> 3 blocks of 2 rows
    return ResultLayout(shape=(6, 5), iter_start=0, iter_stop=1, itemsize=4, block_bytes=40)


def test_blocks_written_in_order_and_readable_with_plain_zarr(tmp_path: Path, layout: ResultLayout) -> None:
    J = np.arange(30, dtype=np.float32).reshape(6, 5)
    with ResultWriter(str(tmp_path), "job1", layout=layout, dtype="float32", attrs={"kind": "jacobian"},
                      retry=FAST) as w:
        assert w.pending_ranges() == [(0, 6)]
        assert w.host_bytes == (2 + 2) * 2 * 5 * 4  # queue_blocks + 2 blocks of 2 rows: what the engine reserves
        feed(w, rows_of(J, layout), [1, 3, 2])  # compute chunks straddle block boundaries
    assert w.committed_blocks() == {0, 1, 2}
    arr = zarr.open_array(str(tmp_path / "job1" / "result.zarr" / "jacobian"), mode="r")
    np.testing.assert_array_equal(arr[:], J)
    assert arr.chunks == (2, 5)
    assert zarr.open_group(str(tmp_path / "job1" / "result.zarr"), mode="r").attrs["kind"] == "jacobian"
    rebuilt = ResultLayout(tuple(arr.attrs["shape"]), arr.attrs["iter_start"], arr.attrs["iter_stop"],
                           arr.attrs["itemsize"], arr.attrs["block_bytes"])
    assert rebuilt.chunks == arr.chunks and len(rebuilt.blocks()) == 3


def test_middle_iterated_axes_are_placed(tmp_path: Path) -> None:
    # shape (2, 3, 4) iterating over axis 1: rows of shape (2, 4), as a batch Jacobian would produce
    layout = ResultLayout(shape=(2, 3, 4), iter_start=1, iter_stop=2, itemsize=8, block_bytes=64)
    J = np.random.default_rng(0).normal(size=(2, 3, 4))
    with ResultWriter(str(tmp_path), "j", layout=layout, dtype="float64", retry=FAST) as w:
        feed(w, rows_of(J, layout), [3])
    np.testing.assert_array_equal(storage.open_result(w.uri)[:], J)


def test_rows_out_of_order_are_refused(tmp_path: Path, layout: ResultLayout) -> None:
    rows = np.zeros((6, 5), np.float32)
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    with pytest.raises(ValueError, match="block start"):
        w.write_rows(1, rows[:1])
    w.write_rows(0, rows[:1])
    with pytest.raises(ValueError, match="expected row 1"):
        w.write_rows(0, rows[:1])
    with pytest.raises(ValueError, match="row_shape"):
        w.write_rows(1, np.zeros((1, 4), np.float32))
    w.abort()


def test_resume_skips_committed_blocks_and_is_bitwise_equal(tmp_path: Path, layout: ResultLayout) -> None:
    J = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
    rows = rows_of(J, layout)
    # uninterrupted reference run
    with ResultWriter(str(tmp_path / "a"), "j", layout=layout, dtype="float32", retry=FAST) as ref:
        feed(ref, rows, [6])
    # interrupted run: block 0 and half of block 1, then the process "dies"
    first = ResultWriter(str(tmp_path / "b"), "j", layout=layout, dtype="float32", retry=FAST)
    feed(first, rows, [2, 1])
    deadline = time.monotonic() + 10
    while first.committed_blocks() != {0} and time.monotonic() < deadline:
        time.sleep(0.01)
    first.abort()
    second = ResultWriter(str(tmp_path / "b"), "j", layout=layout, dtype="float32", retry=FAST)
    assert second.committed_blocks() == {0}
    assert second.rows_committed == 2
    assert second.pending_ranges() == [(2, 6)]
    feed(second, rows[2:], [4], start=2)
    second.write_manifest({"kind": "jacobian"})
    np.testing.assert_array_equal(storage.open_result(second.uri)[:], J)
    chunk_files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("c/*/*"))
    assert len(chunk_files) == 3
    for rel in chunk_files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


def test_rewriting_a_block_gives_identical_bytes(tmp_path: Path, layout: ResultLayout) -> None:
    rows = np.random.default_rng(2).normal(size=(6, 5)).astype(np.float32)
    with ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST) as w:
        feed(w, rows, [6])
    before = {p: p.read_bytes() for p in (tmp_path / "j" / "result.zarr").rglob("*") if p.is_file()}
    # resumed writer that recomputes an already committed block: dropped, nothing changes
    with ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST) as again:
        assert again.pending_ranges() == []
        again.write_rows(2, rows[2:4])
    after = {p: p.read_bytes() for p in (tmp_path / "j" / "result.zarr").rglob("*") if p.is_file()}
    assert before == after


def test_manifest_is_written_last_and_only_when_complete(tmp_path: Path, layout: ResultLayout) -> None:
    rows = np.ones((6, 5), np.float32)
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    feed(w, rows[:4], [4])
    w.close()
    manifest = tmp_path / "j" / "manifest.json"
    assert not manifest.exists()
    w2 = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    with pytest.raises(RuntimeError, match="not committed"):
        w2.write_manifest({})
    assert not manifest.exists()
    w3 = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    feed(w3, rows[4:], [2], start=4)
    w3.write_manifest({"kind": "jacobian", "plan": {"chunk_rows": 2}})
    body = json.loads(manifest.read_text())
    assert body["id"] == "j" and body["shape"] == [6, 5] and body["dtype"] == "float32"
    assert body["chunks"] == [2, 5] and body["rows"] == [0, 6] and body["kind"] == "jacobian"
    assert body["uri"] == str(tmp_path / "j" / "result.zarr") and body["array"] == "jacobian"


class FlakyArray:
    """Wraps a zarr array; the first ``failures`` writes raise ``OSError``; optional gate per write."""

    def __init__(self, inner, failures: int, gate: threading.Event | None = None) -> None:
        self.inner, self.failures, self.gate, self.calls = inner, failures, gate, 0

    def __setitem__(self, key, value) -> None:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.failures > 0:
            self.failures -= 1
            raise OSError("storage unavailable")
        self.inner[key] = value


def test_failing_store_is_retried_then_succeeds(tmp_path: Path, layout: ResultLayout) -> None:
    rows = np.full((6, 5), 3.0, np.float32)
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    w._array = flaky = FlakyArray(w._array, failures=2)
    feed(w, rows, [6])
    w.close()
    assert flaky.calls == 5 and w.committed_blocks() == {0, 1, 2}
    np.testing.assert_array_equal(storage.open_result(w.uri)[:], rows)


def test_failing_store_raises_after_bounded_retries(tmp_path: Path, layout: ResultLayout) -> None:
    rows = np.zeros((6, 5), np.float32)
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    w._array = flaky = FlakyArray(w._array, failures=10**6)
    with pytest.raises(ResultWriteError, match="after 3 attempts") as info:
        feed(w, rows, [2])
        w.close()
    assert isinstance(info.value.__cause__, OSError)
    assert flaky.calls == 3
    assert w.committed_blocks() == set()
    with pytest.raises(ResultWriteError):
        w.write_rows(2, rows[2:4])
    with pytest.raises(ResultWriteError):
        w.write_manifest({})
    assert not (tmp_path / "j" / "manifest.json").exists()


def test_upload_queue_is_bounded(tmp_path: Path) -> None:
    layout = ResultLayout(shape=(8, 5), iter_start=0, iter_stop=1, itemsize=4, block_bytes=20)  # 8 blocks
    gate = threading.Event()
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    w._array = FlakyArray(w._array, failures=0, gate=gate)
    rows = np.ones((8, 5), np.float32)
    producer = threading.Thread(target=feed, args=(w, rows, [1] * 8))
    producer.start()
    time.sleep(0.3)
    # one block in the writer thread, two queued: the producer waits for room
    assert producer.is_alive() and w._queue.qsize() == 2
    gate.set()
    producer.join(10)
    w.close()
    assert w.committed_blocks() == set(range(8))


def test_settle_returns_when_the_queued_blocks_are_written(tmp_path: Path) -> None:
    """The engine settles the writer before a timed call: when ``settle`` returns, every block handed over is
    committed (the writer's thread idle), however slow storage is; it waits for nothing once the thread died."""
    layout = ResultLayout(shape=(8, 5), iter_start=0, iter_stop=1, itemsize=4, block_bytes=40)  # 4 blocks
    gate = threading.Event()
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    w._array = FlakyArray(w._array, failures=0, gate=gate)
    rows = np.ones((8, 5), np.float32)
    feed(w, rows, [4])                      # blocks 0 and 1 handed over, both held at the gate
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    w.settle()
    assert time.monotonic() - t0 >= 0.25
    assert w.committed_blocks() == {0, 1} and w._queue.unfinished_tasks == 0
    t0 = time.monotonic()
    w.settle()                              # nothing queued: returns at once
    assert time.monotonic() - t0 < 0.05
    feed(w, rows[4:], [4], start=4)
    w.close()
    assert w.committed_blocks() == {0, 1, 2, 3}


def test_settle_gives_up_on_a_failed_or_stuck_writer(tmp_path: Path, layout: ResultLayout) -> None:
    """A failed writer's thread is gone: ``settle`` returns at once and ``close`` reports the failure; a stuck
    store holds ``settle`` no longer than its timeout."""
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    w._array = FlakyArray(w._array, failures=10**6)
    feed(w, np.zeros((6, 5), np.float32), [2])
    w._thread.join(5)
    t0 = time.monotonic()
    w.settle()
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(ResultWriteError):
        w.close()
    stuck = ResultWriter(str(tmp_path), "k", layout=layout, dtype="float32", retry=FAST)
    gate = threading.Event()
    stuck._array = FlakyArray(stuck._array, failures=0, gate=gate)
    feed(stuck, np.zeros((6, 5), np.float32), [2])
    t0 = time.monotonic()
    stuck.settle(timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t0 < 2 and stuck.committed_blocks() == set()
    gate.set()
    stuck.close()
    assert stuck.committed_blocks() == {0}


def test_shard_rows_must_align_with_blocks(tmp_path: Path, layout: ResultLayout) -> None:
    with pytest.raises(ValueError, match="block"):
        ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", rows=(1, 4))
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", rows=(2, 6), retry=FAST)
    assert w.pending_ranges() == [(2, 6)] and w.rows_total == 4
    w.abort()


def test_storage_helpers_on_local_paths(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/a/b.bin"
    storage.write_bytes(url, b"xyz")
    assert storage.read_bytes(str(tmp_path / "a" / "b.bin")) == b"xyz"
    assert storage.exists(url) and storage.list_names(str(tmp_path / "a")) == ["b.bin"]
    storage.delete_prefix(str(tmp_path / "a"))
    assert not storage.exists(url) and storage.list_names(str(tmp_path / "a")) == []
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(url)


@pytest.mark.parametrize("n_blocks", [4, 64])
def test_manifest_lists_the_commit_markers_once(tmp_path: Path, monkeypatch, n_blocks: int) -> None:
    """``write_manifest`` reads the markers in one listing, however many blocks (one LIST on S3, not n)."""
    layout = ResultLayout(shape=(n_blocks, 5), iter_start=0, iter_stop=1, itemsize=4, block_bytes=20)  # 1 row/block
    w = ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32", retry=FAST)
    feed(w, np.ones((n_blocks, 5), np.float32), [n_blocks])
    w.close()
    listed: list[str] = []
    real = storage.list_names
    monkeypatch.setattr(storage, "list_names", lambda url: listed.append(url) or real(url))
    w.write_manifest({})
    assert (tmp_path / "j" / "manifest.json").is_file()
    assert len(listed) == 1, f"{len(listed)} listings for {n_blocks} blocks"


def test_products_are_held_in_runs_of_whole_blocks_within_the_bound():
    from types import SimpleNamespace

    from worker.matfree_job import _runs

    blocks = [SimpleNamespace(row_start=a, row_stop=a + 10) for a in range(0, 100, 10) if a not in (30, 40)]
    writer = SimpleNamespace(layout=SimpleNamespace(row_bytes=8), pending_blocks=lambda: blocks)
    # 10 seeds of 8 bytes a block; at most 240 bytes held: 3 blocks a run, and a gap (committed blocks) cuts it
    assert _runs(writer, 240) == [(0, 30), (50, 80), (80, 100)]
    assert _runs(writer, 1) == [(b.row_start, b.row_stop) for b in blocks]      # at least one block
    assert _runs(writer, 1 << 30) == [(0, 30), (50, 100)]
