"""Hand back the pages of shared libraries that only their loading read, around TensorFlow's import.

Loading TensorFlow leaves about 380 MiB of ``libtensorflow_cc.so.2`` and ``libtensorflow_framework.so.2`` in a
process's resident set that no job reads again (TensorFlow 2.21, a 2-core Xeon; ``/proc/self/pagemap`` by
section): the dynamic linker's symbol names, symbols and relocations (``.dynstr`` 83 MiB, ``.dynsym`` 11,
``.rela.dyn`` 19, all of each) and the code of the static initialisers that register every op and kernel (171 of
``.text``'s 346 MiB, with the kernel's fault-around mapping 64 KiB about each page touched). They are clean pages
of the library's file, but while they are mapped the kernel's reclaim keeps them longer (executable pages that were
used get another round on its active list), and they are counted in the process's own figures: its resident set and
peak (``VmRSS``, ``VmHWM``, ``top``, the OOM killer's score, ``host_peak``'s host budget). A process that only imports
TensorFlow and loads a small model holds 540 MiB, of which 140 are its own (anonymous) memory. (A container's
``memory.current`` counts the page cache whether mapped or not: there the pages stay charged until reclaimed.)

``release()`` ``madvise(MADV_DONTNEED)``s every private, read-only mapping of a loaded shared library that holds no
page of its own (no dirty, anonymous, swapped or locked page: a relocated read-only segment, ``.data.rel.ro`` after
RELRO, has them and is left alone, as is anything writable). For such a mapping the call only unmaps: the pages stay
in the page cache, reclaimable like any file page, and a page read again is mapped again from there (a minor fault;
from the file, if reclaim has taken it meanwhile) with the same bytes, as a file-backed page always may be. The
process above falls to about 200 MiB, and a gradient then maps back 45 MiB of TensorFlow's libraries.

Between reading smaps and the ``madvise`` a mapping must stay what it was read as, so nothing is done while another
Python thread runs (one could load or unload a library meanwhile), and a library counts as loaded only once its
writable segment is mapped (the dynamic linker first maps a library whole, read-only, and lays out its segments over
that mapping). What is left is a library with text relocations loaded by a thread of C++ code at that moment, which
TensorFlow's import and its jobs do not do: nothing else can change the bytes a mapping reads. An error of any kind
(smaps unreadable or unparsable, no ``madvise``) releases nothing and is logged at debug level: this is an
optimisation, and it never fails an import.

It is called three times in a process that imports TensorFlow through the engine: as TensorFlow's import starts
(``tf_import``'s finder: the libraries loaded before it, 16 MiB of a ``jacobian compute`` process, are then not
resident under the peak that loading TensorFlow's makes, which is the process's peak on small models), once
TensorFlow's libraries are loaded (the same finder, before TensorFlow's Python modules are imported on top of them),
and at the end of ``host_peak.freeze_imports``.

Linux only (``/proc/self/smaps``, glibc's ``madvise``); elsewhere, or with ``JACOBIAN_RELEASE_LIBRARY_PAGES=0``,
nothing is done. Each call costs 5-20 ms (reading smaps).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from collections.abc import Callable
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
    """The mappings of a ``/proc/<pid>/smaps`` text, with their resident and own kibibytes (a line that does not
    parse is skipped)."""
    out: list[Mapping] = []
    for line in text.split("\n"):   # not splitlines(): a path may hold characters it splits on
        head = _HEADER.match(line)
        if head:
            out.append(Mapping(int(head[1], 16), int(head[2], 16), head[3], head[4].strip()))
            continue
        field, _, rest = line.partition(":")
        words = rest.split()
        if not out or len(words) != 2 or words[1] != "kB" or not words[0].isdigit():
            continue
        if field == "Rss":
            out[-1].rss_kib = int(words[0])
        elif field in OWN_PAGES:
            out[-1].own_kib += int(words[0])
    return out


def to_release(found: list[Mapping]) -> list[Mapping]:
    """The mappings of ``found`` to release: clean and read-only (``Mapping.releasable``), of a library whose
    writable segment is mapped (loaded, not half-way through the dynamic linker's ``dlopen``)."""
    laid_out = {m.path for m in found if "w" in m.perms}
    return [m for m in found if m.releasable and m.path in laid_out]


def _other_threads() -> int:
    return threading.active_count() - 1


def _madvise() -> Callable[[int, int, int], int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def release(smaps_path: str = SMAPS) -> int:
    """Unmap the resident pages of loaded shared libraries' clean read-only mappings (see the module's text); the
    KiB that were resident in them (0 where nothing was done: turned off, another Python thread running, an error)."""
    if not enabled():
        return 0
    others = _other_threads()
    if others:
        log.debug("library pages not released: %d other Python threads run", others)
        return 0
    try:
        with open(smaps_path, "rb") as fh:
            found = to_release(mappings(fh.read().decode("utf-8", "surrogateescape")))
        madvise = _madvise()
        released = 0
        for m in found:
            if madvise(m.start, m.end - m.start, MADV_DONTNEED) == 0:
                released += m.rss_kib
    except Exception as err:  # noqa: BLE001 - an optimisation: it must never fail the import it runs in
        log.debug("library pages not released: %s: %s", type(err).__name__, err)
        return 0
    log.debug("released %d MiB of shared libraries' clean pages", released >> 10)
    return released
