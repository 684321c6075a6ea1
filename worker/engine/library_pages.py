"""Hand back the pages of shared libraries that only their loading read, around TensorFlow's import.

Loading TensorFlow leaves about 380 MiB of ``libtensorflow_cc.so.2`` and ``libtensorflow_framework.so.2`` in a
process's resident set that no job reads again (TensorFlow 2.21, a 2-core Xeon; ``/proc/self/pagemap`` by
section): the dynamic linker's symbol names, symbols and relocations (``.dynstr`` 83 MiB, ``.dynsym`` 11,
``.rela.dyn`` 19, all of each) and the code of the static initialisers that register every op and kernel (171 of
``.text``'s 346 MiB, with the kernel's fault-around mapping 64 KiB about each page touched). They are clean pages
of the library's file, but while they are mapped the kernel's reclaim keeps them (executable pages that were used
get another round on its active list), and they are counted in the process's resident set, which is what a container's
working set, ``top`` and a host job's memory budget read: a process that only imports TensorFlow and loads a small
model holds 540 MiB, of which 140 are its own (anonymous) memory.

``release()`` ``madvise(MADV_DONTNEED)``s every private, read-only mapping of a shared library that holds no page
of its own (no dirty or anonymous page: a relocated read-only segment, ``.data.rel.ro`` after RELRO, has them and
is left alone, as is anything writable). For such a mapping the call only unmaps: the pages stay in the page cache,
reclaimable like any file page, and a page read again is mapped again from there (a minor fault) with the same
bytes, as a file-backed page always may be. The process above falls to about 200 MiB, and a gradient then maps
back 45 MiB of TensorFlow's libraries. Nothing is written, and nothing that can change is dropped.

It is called three times in a process that imports TensorFlow through the engine: as TensorFlow's import starts
(``tf_import``'s finder: the libraries loaded before it, 16 MiB of a ``jacobian compute`` process, are then not
resident under the peak that loading TensorFlow's makes, which is the process's peak on small models), once
TensorFlow's libraries are loaded (the same finder, before TensorFlow's Python modules are imported on top of them),
and at the end of ``host_peak.freeze_imports``. Each is made where no other thread loads or unloads a library: a
mapping is read from smaps and then advised, and must still be the same mapping then.

Linux only (``/proc/self/smaps``, glibc's ``madvise``); elsewhere, or with ``JACOBIAN_RELEASE_LIBRARY_PAGES=0``,
nothing is done. Each call costs 5-20 ms (reading smaps).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

SMAPS = "/proc/self/smaps"
MADV_DONTNEED = 4
ENV = "JACOBIAN_RELEASE_LIBRARY_PAGES"
READ_ONLY = ("r--p", "r-xp")
OWN_PAGES = ("Private_Dirty", "Shared_Dirty", "Anonymous", "Swap", "Locked")   # any of these: not only the file's
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")


@dataclass
class Mapping:
    start: int
    end: int
    perms: str
    path: str
    rss_kib: int = 0
    own_kib: int = 0   # pages that are not the file's: dirty, anonymous (copied on write), swapped, locked

    @property
    def releasable(self) -> bool:
        return (self.perms in READ_ONLY and self.own_kib == 0 and self.rss_kib > 0
                and bool(_SHARED_OBJECT.search(self.path)))


def mappings(text: str) -> list[Mapping]:
    """The mappings of a ``/proc/<pid>/smaps`` text, with their resident and own kibibytes."""
    out: list[Mapping] = []
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            out.append(Mapping(int(head[1], 16), int(head[2], 16), head[3], head[4].strip()))
            continue
        field, _, rest = line.partition(":")
        if not out or not rest.strip().endswith("kB"):
            continue
        kib = int(rest.split()[0])
        if field == "Rss":
            out[-1].rss_kib = kib
        elif field in OWN_PAGES:
            out[-1].own_kib += kib
    return out


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def release(smaps_path: str = SMAPS) -> int:
    """Unmap the resident pages of shared libraries' clean read-only mappings (see the module's text); the KiB that
    were resident in them (0 where nothing could be done)."""
    if not enabled():
        return 0
    try:
        with open(smaps_path) as fh:
            found = mappings(fh.read())
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError) as err:
        log.debug("library pages not released: %s", err)
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for m in found:
        if m.releasable and madvise(m.start, m.end - m.start, MADV_DONTNEED) == 0:
            released += m.rss_kib
    log.debug("released %d MiB of shared libraries' clean pages", released >> 10)
    return released
