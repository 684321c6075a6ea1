"""Which mappings ``worker.engine.library_pages`` hands back: only a shared library's clean read-only ones.

The real release (TensorFlow's libraries in a fresh process, a gradient after it) is in
``tests/engine/test_library_pages.py`` (this is the pure part)."""

from __future__ import annotations

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


def test_release_unmaps_nothing_when_turned_off(monkeypatch, tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    monkeypatch.setenv(library_pages.ENV, "0")
    assert library_pages.release(str(smaps)) == 0


def test_release_where_proc_cannot_be_read_does_nothing(tmp_path):
    assert library_pages.release(str(tmp_path / "no-such-smaps")) == 0
