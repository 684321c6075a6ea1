"""Which host chunks read the process's peak (``HostPeaks``): a reading trims the heap, and the chunk then faults
its pages in again (an 8-row MobileNetV3Small chunk: 0.18 s without, 0.23-0.25 s with), so a settled size's chunks
are read on their first ``SPANS_PER_SIZE`` and every ``RECHECK_SPAN``-th after, and every chunk whose reading
decides something is read; a chunk left unread is no timing sample."""

from __future__ import annotations

from types import SimpleNamespace

from worker.engine.host_peak import PROCESS_RSS, HostPeaks
from worker.engine.ladder import Ladder


def _record(measure: str = PROCESS_RSS) -> SimpleNamespace:
    return SimpleNamespace(peak_unseen=False, peak_measure=measure)


def _spans(host: HostPeaks, record, calls: list[tuple[tuple[str, int], bool]], monkeypatch) -> list[bool]:
    """Whether each ``(size, decides)`` call started a span (the real start counted, not replaced)."""
    started = []
    real = host.resident.start
    monkeypatch.setattr(host.resident, "start", lambda: (started.append(True), real())[1])
    out = []
    for size, decides in calls:
        before = len(started)
        host.before(record, blind=False, first=False, size=size, decides=decides)
        host.after(record, 0, 1)
        out.append(len(started) > before)
        assert host.skipped is not out[-1]
    return out


def test_a_settled_size_is_read_on_its_first_chunks_and_then_every_sixteenth(monkeypatch):
    host = HostPeaks()
    spans = _spans(host, _record(), [(("tiled", 8), False)] * 40, monkeypatch)
    read = [i for i, s in enumerate(spans) if s]
    assert read == [0, 1, 16, 32], read
    # another size of the same strategy, or another strategy, has readings of its own
    assert _spans(host, _record(), [(("tiled", 16), False), (("vectorized", 8), False)], monkeypatch) == [True, True]


def test_every_chunk_whose_reading_decides_is_read(monkeypatch):
    host = HostPeaks()
    calls = [(("tiled", 8), False)] * 4 + [(("tiled", 8), True)] * 3 + [(("tiled", 8), False)] * 2
    assert _spans(host, _record(), calls, monkeypatch) == [True, True, False, False, True, True, True, False, False]


def test_a_first_call_or_a_strategy_the_allocator_sees_is_never_read(monkeypatch):
    host = HostPeaks()
    started = []
    monkeypatch.setattr(host.resident, "start", lambda: started.append(True))
    host.before(_record(), blind=False, first=True, size=("tiled", 8), decides=True)
    host.before(_record(measure="allocator"), blind=False, first=False, size=("tiled", 8), decides=True)
    assert not started and not host.skipped


def test_an_unread_chunk_of_a_settled_size_is_no_sample():
    ladder = Ladder(size=8, growing=False, calibrated=True)
    ladder.observe(8, 0.24, 100, warm=True, can_grow_to=lambda n: False)
    ladder.observe(8, 0.24, 100, warm=True, can_grow_to=lambda n: False)
    ladder.observe(8, 0.18, 0, warm=True, can_grow_to=lambda n: False, sampled=False)
    assert ladder.samples[8] == [0.03] and ladder.peaks[8] == 100   # the first call after none of its size: untimed
    # a comparison under way takes every chunk it is given (its chunks are read: ``decides``)
    ladder.comparison = None
    ladder.growing = True
    ladder.observe(8, 0.16, 0, warm=True, can_grow_to=lambda n: False, sampled=False)
    assert ladder.samples[8] == [0.03, 0.02]
