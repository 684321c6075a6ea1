"""The process's resident memory on a host (CPU) job: what TensorFlow's allocator statistics do not see.

The CPU allocator's statistics count allocations from about 128 KiB up and none of XLA's, so a strategy
that runs a row at a time (``loop``) or compiles with XLA peaks at ~0 bytes by them (an LSTM's quote said
0.1 MiB). Linux keeps the process's peak resident set (``VmHWM`` in /proc/self/status) and resets it to
the current resident set when "5" is written to /proc/self/clear_refs (Linux 4.0+): the peak over a chunk,
less what was resident when it started, is what the chunk made the process hold. It is a process RSS delta,
not allocator bytes: memory the allocator reuses from earlier chunks without touching new pages is not in
it (a new size's first call, which pays its trace, usually shows the most), and other threads' memory is.
Where the files cannot be read or written (not Linux, a locked-down /proc) nothing is measured: None.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"
RESET_PEAK = "5"   # clear_refs: reset the peak resident set size (VmHWM) to the current one


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

    ``start()`` resets the kernel's peak (``VmHWM``) and reads ``VmRSS``; ``delta()`` is then
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
