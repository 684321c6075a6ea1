"""The process's resident memory on a host (CPU) job: what TensorFlow's allocator statistics do not see.

On the CPU TensorFlow keeps no allocator statistics unless something turned them on (TensorFlow 2.21:
``get_memory_info("CPU:0")`` raises "Allocator stats not available" in a fresh process; where they are
on, they count allocations from about 128 KiB up and none of XLA's), so a host chunk's peak reads 0 by
them (an LSTM's quote said 0.1 MiB). Linux keeps the process's peak resident set (``VmHWM`` in
/proc/self/status) and resets it to the current resident set when "5" is written to /proc/self/clear_refs
(Linux 4.0+): the peak over a chunk, less what was resident when it started, is what the chunk made the
process hold. Freed heap that malloc keeps would serve a chunk without new pages (a loop chunk of an LSTM
then reads 0.0-0.7 MiB, at random), so a span starts with glibc's ``malloc_trim(0)`` (under 1 ms in a
TensorFlow process): the LSTM's 8-row chunks then read 1.2-2.2 MiB in a fresh process, 64-row ones
2.5-2.6 MiB. A process that has run a test suite holds partly used pages that no trim returns, and there
the same chunks read 0.25-0.4 MiB. It is still a process RSS delta, not allocator bytes: other threads'
memory is in it. A strategy's first call (its trace: 12-34 MiB of graph on that LSTM) is not measured
(``HostPeaks``); a new size that compiles anew (XLA) still shows its compile. Where the files cannot be
read or written (not Linux, a locked-down /proc) nothing is measured: None.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import lru_cache
from typing import Any

log = logging.getLogger(__name__)

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"
RESET_PEAK = "5"   # clear_refs: reset the peak resident set size (VmHWM) to the current one


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim   # glibc; musl and macOS have none
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Give the heap's free memory back to the kernel (glibc's ``malloc_trim(0)``); False where there is none."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


_FROZEN = False


def freeze_imports(*modules: str) -> None:
    """Import TensorFlow (and ``modules``) with the cyclic garbage collector off, then put every object alive now
    out of its reach, once per process (``gc.freeze``): a process that runs jobs calls it before its first one,
    when what is alive is TensorFlow's modules and the engine's, which live as long as the process anyway.

    TensorFlow's import makes about 270,000 objects that the collector would walk again and again as they grow
    (0.27 s of full collections in a 2.4 s import, 2-core EPYC); after the freeze each collection walks only what
    jobs made since: a cold ``jacobian compute`` of the transformer encoder spent 0.2 s collecting after its
    float64 probes (``precision._drop_copy``), 0.01 s with the freeze, and its probes took 0.47 s, not 0.67 s.
    A module imported before this call was imported with the collector on (no harm, only slower). Then the pages of
    shared libraries that only the import read are handed back (``library_pages.release``)."""
    global _FROZEN
    if _FROZEN:
        return
    import gc
    import importlib

    was_on = gc.isenabled()
    gc.disable()
    try:
        for name in ("tensorflow", *modules):
            importlib.import_module(name)
    finally:
        gc.freeze()
        _FROZEN = True
        if was_on:
            gc.enable()
    from worker.engine import library_pages

    library_pages.release()   # what only the import read: the dynamic linker's tables, static initialisers


def status_bytes(field: str, path: str | None = None) -> int | None:
    """``field`` (``VmRSS``, ``VmHWM``) of /proc/self/status in bytes; None where it cannot be read."""
    try:
        with open(path or STATUS) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024   # "VmRSS:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int | None:
    """This process's resident set now (``VmRSS``); None where /proc cannot tell."""
    return status_bytes("VmRSS")


class ResidentPeak:
    """The peak resident bytes of this process over a span, above what was resident at its start.

    ``start()`` trims the heap, resets the kernel's peak (``VmHWM``) and reads ``VmRSS``; ``delta()`` is then
    ``VmHWM - VmRSS at start`` (>= 0), or None when either file failed: after a first failure the
    object stops trying (``available`` false) and says so once in the log.
    """

    def __init__(self) -> None:
        self.available = True
        self._base: int | None = None

    def _give_up(self, why: str) -> None:
        if self.available:
            log.info("no host peak from /proc (%s): host chunks' peaks are the allocator's alone", why)
        self.available, self._base = False, None

    def start(self) -> None:
        self._base = None
        if not self.available:
            return
        trim_heap()
        try:
            with open(CLEAR_REFS, "w") as fh:
                fh.write(RESET_PEAK)
        except OSError as err:
            self._give_up(f"{CLEAR_REFS}: {err.strerror or err}")
            return
        self._base = resident_bytes()
        if self._base is None:
            self._give_up(f"{STATUS} has no VmRSS")

    def delta(self) -> int | None:
        if self._base is None:
            return None
        hwm = status_bytes("VmHWM")
        if hwm is None:
            self._give_up(f"{STATUS} has no VmHWM")
            return None
        return max(0, hwm - self._base)


PROCESS_RSS = "process_rss"   # a plan record's ``peak_measure`` when its peaks are RSS deltas


class HostPeaks:
    """A host job's chunk peaks where TensorFlow's allocator statistics miss them: ``before`` a chunk that does
    not trace (a trace's graph is no chunk's memory, nor counted by the allocator) of a strategy that escapes
    the statistics (``blind``: a row at a time; its record ``peak_unseen``; or measured by RSS before), the span
    starts; ``after`` it the peak is the larger of the allocator's and the RSS delta, and the record says
    ``peak_measure = "process_rss"``. A chunk whose allocator peak is below its own result bytes was not seen
    either: its strategy is measured by RSS from the next chunk on. ``footprint``: the process's resident
    bytes when the job started (0 where /proc cannot tell), what host growth weighs a doubling against.

    A span is not free: its trim gives the heap's free pages back, and the chunk faults them in again (an 8-row
    MobileNetV3Small chunk on a 2-core AVX2 VM: 0.18 s without a span, 0.23-0.25 s with one). So a span is taken
    where a reading decides something (``decides``: a comparison of sizes or a trial under way; the caller says),
    on the first ``SPANS_PER_SIZE`` chunks of each strategy and size, and on every ``RECHECK_SPAN``-th after them;
    ``skipped`` says that the last chunk ran without the span it would have had (its time is no sample: the
    plan's rates stay those of measured chunks, comparable with each other)."""

    SPANS_PER_SIZE = 2
    RECHECK_SPAN = 16

    def __init__(self) -> None:
        self.resident = ResidentPeak()
        self.resident.start()   # a first span now, so that ``available`` is known before any chunk is marked
        self.footprint = resident_bytes() or 0
        self._span = False
        self.skipped = False
        self._chunks: dict[Any, int] = {}   # (strategy, rows) -> chunks that wanted a span

    def before(self, record: Any, *, blind: bool, first: bool, size: Any, decides: bool) -> None:
        wanted = not first and (blind or record.peak_unseen or record.peak_measure == PROCESS_RSS)
        seen = self._chunks.get(size, 0)
        if wanted:
            self._chunks[size] = seen + 1
        self._span = wanted and (decides or seen < self.SPANS_PER_SIZE or seen % self.RECHECK_SPAN == 0)
        self.skipped = wanted and not self._span
        if self._span:
            self.resident.start()

    def after(self, record: Any, allocator_peak: int, result_bytes: int) -> int:
        rss = self.resident.delta() if self._span else None
        self._span = False
        if self.skipped:
            return allocator_peak
        if rss is None and not (self.resident.available and allocator_peak < result_bytes):
            return allocator_peak
        record.peak_measure = PROCESS_RSS
        return max(allocator_peak, rss or 0)
