"""Which mappings ``worker.engine.library_pages`` hands back: only a shared library's clean read-only ones.

The real release (TensorFlow's libraries in a fresh process, a gradient after it) is in
``tests/engine/test_library_pages.py`` (this is the pure part)."""

from __future__ import annotations

import pytest

from worker.engine import library_pages

SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 08:01 123 /venv/tensorflow/libtensorflow_cc.so.2
Size:               1024 kB
Rss:                 900 kB
Private_Clean:       900 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
Swap:                  0 kB
Locked:                0 kB
7f0000100000-7f0000200000 r-xp 00100000 08:01 123 /venv/tensorflow/libtensorflow_cc.so.2
Rss:                 700 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000200000-7f0000300000 r--p 00200000 08:01 123 /venv/tensorflow/libtensorflow_cc.so.2
Rss:                 600 kB
Private_Dirty:       600 kB
Anonymous:           600 kB
7f0000300000-7f0000301000 rw-p 00300000 08:01 123 /venv/tensorflow/libtensorflow_cc.so.2
Rss:                   4 kB
Private_Dirty:         4 kB
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
Rss:                 500 kB
Anonymous:           500 kB
7f0000500000-7f0000600000 r--p 00000000 08:01 124 /data/weights.bin
Rss:                 100 kB
7f0000600000-7f0000700000 r--s 00000000 08:01 125 /venv/lib/shared.so
Rss:                 100 kB
7f0000700000-7f0000800000 r-xp 00000000 08:01 126 /venv/numpy/_umath.cpython-311-x86_64-linux-gnu.so
Rss:                   0 kB
7f0000800000-7f0000900000 r-xp 00000000 08:01 127 /venv/lib/libmlocked.so.1.2
Rss:                  64 kB
Locked:               64 kB
7f0000900000-7f0000a00000 r-xp 00000000 08:01 128 /venv/lib/libpython3.11.so.1.0 (deleted)
Rss:                  64 kB
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   4 kB
"""


def test_only_clean_read_only_mappings_of_shared_libraries_are_releasable():
    found = library_pages.mappings(SMAPS)
    assert [(m.perms, m.path.rsplit("/", 1)[-1], m.rss_kib, m.own_kib) for m in found] == [
        ("r--p", "libtensorflow_cc.so.2", 900, 0),
        ("r-xp", "libtensorflow_cc.so.2", 700, 0),
        ("r--p", "libtensorflow_cc.so.2", 600, 1200),   # relocated, then made read-only (RELRO): its own pages
        ("rw-p", "libtensorflow_cc.so.2", 4, 4),
        ("rw-p", "", 500, 500),
        ("r--p", "weights.bin", 100, 0),
        ("r--s", "shared.so", 100, 0),
        ("r-xp", "_umath.cpython-311-x86_64-linux-gnu.so", 0, 0),
        ("r-xp", "libmlocked.so.1.2", 64, 64),
        ("r-xp", "libpython3.11.so.1.0 (deleted)", 64, 0),
        ("r-xp", "[vdso]", 4, 0),
    ]
    assert [m.start for m in found if m.releasable] == [0x7f0000000000, 0x7f0000100000]


@pytest.fixture
def advised(monkeypatch):
    """The ranges ``release`` would advise, recorded instead of advised: a made-up smaps names addresses that may be
    this process's own memory."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(library_pages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    # and this process alone, as it is when the engine imports TensorFlow (a test suite leaves threads behind)
    monkeypatch.setattr(library_pages, "_other_threads", lambda: 0)
    return calls


def test_release_advises_the_clean_read_only_mappings_of_loaded_libraries(tmp_path, advised):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert library_pages.release(str(smaps)) == 900 + 700
    assert advised == [(0x7f0000000000, 0x100000, library_pages.MADV_DONTNEED),
                       (0x7f0000100000, 0x100000, library_pages.MADV_DONTNEED)]


def test_release_unmaps_nothing_when_turned_off(monkeypatch, tmp_path, advised):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    monkeypatch.setenv(library_pages.ENV, "0")
    assert library_pages.release(str(smaps)) == 0
    assert advised == []


def test_release_where_proc_cannot_be_read_does_nothing(tmp_path, advised):
    assert library_pages.release(str(tmp_path / "no-such-smaps")) == 0
    assert advised == []


def test_a_library_counts_as_loaded_once_its_writable_segment_is_mapped():
    """The dynamic linker maps a library whole and read-only first, then its segments over that mapping: a library
    seen half-way (no writable mapping of its path yet) is not released."""
    half_loaded = "7f1000000000-7f1000400000 r--p 00000000 08:01 200 /venv/lib/libnew.so\nRss: 64 kB\n"
    chosen = library_pages.to_release(library_pages.mappings(SMAPS + half_loaded))
    assert [(m.start, m.path.rsplit("/", 1)[-1]) for m in chosen] == [
        (0x7f0000000000, "libtensorflow_cc.so.2"), (0x7f0000100000, "libtensorflow_cc.so.2")]


def test_odd_paths_and_lines_parse_and_never_raise(tmp_path, advised):
    """Paths are not escaped by the kernel: bytes that are not UTF-8, and characters ``str.splitlines`` splits on
    (U+001C, U+0085, U+2028)."""
    odd = ("7f2000000000-7f2000100000 r-xp 00000000 08:01 300 /venv/lib/\x1ckB x\x85\u2028.so\n"
           "Rss:                 64 kB\n"
           "Rss:  not-a-number kB\n"
           "VmFlags: rd ex mr mw me\n"
           "garbage line\n").encode() + b"7f3000000000-7f3000100000 r-xp 00000000 08:01 301 /venv/\xff.so\nRss: 8 kB\n"
    smaps = tmp_path / "smaps"
    smaps.write_bytes(SMAPS.encode() + odd)
    found = library_pages.mappings(smaps.read_bytes().decode("utf-8", "surrogateescape"))
    assert [(m.path, m.rss_kib) for m in found[-2:]] == [("/venv/lib/\x1ckB x\x85\u2028.so", 64),
                                                         ("/venv/\udcff.so", 8)]
    assert library_pages.release(str(smaps)) == 900 + 700   # the odd libraries have no writable segment mapped
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(library_pages, "mappings", lambda text: 1 / 0)
    try:
        assert library_pages.release(str(smaps)) == 0   # any error: nothing released, nothing raised
    finally:
        monkeypatch.undo()


def test_nothing_is_released_while_another_python_thread_runs(tmp_path, advised, monkeypatch):
    import threading

    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    monkeypatch.setattr(library_pages, "_other_threads", lambda: threading.active_count() - 1)   # the real count
    try:
        assert library_pages.release(str(smaps)) == 0
    finally:
        stop.set()
        other.join()
    assert advised == []
    monkeypatch.setattr(library_pages, "_other_threads", lambda: 0)
    assert library_pages.release(str(smaps)) == 900 + 700   # alone again
