"""Chunk growth on a host (CPU) job (worker.engine.tuning, "Growth on a host job"): the bar grows with the
memory a doubling adds to the process, the pairs' spread must be cleared, and a doubling the last one says
cannot pay is not compared. Fake timings and peaks, no TensorFlow."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from tests.ladder_drive import drive as drive_sizes
from worker.engine import tuning
from worker.engine.ladder import Ladder
from worker.engine.tuning import (
    GROWTH_GAIN,
    host_growth_gain,
    host_growth_verdict,
    next_doubling_gain,
)

MiB = 1 << 20
# MobileNetV3Small ``tiled`` on the 2-core VM: ~13 MiB a chunk row, a process of ~1.2 GiB before its chunks
MOBILENET_PEAK = (5 * MiB, 13 * MiB)
MOBILENET_FOOTPRINT = 1230 * MiB


def drive(ladder: Ladder, seconds_of: Callable[[int, int], float], chunks: int, **options: Any) -> list[int]:
    """``tests.ladder_drive.drive`` with MobileNetV3Small's peaks unless ``peak_of`` is given."""
    options.setdefault("peak_of", lambda k: MOBILENET_PEAK[0] + MOBILENET_PEAK[1] * k)
    return drive_sizes(ladder, seconds_of, chunks, **options)


def loaded(fixed: float = 0.25, per_row: float = 0.012, sigma: float = 0.0,
           seed: int = 0) -> Callable[[int, int], float]:
    """A chunk's seconds beside CPU hogs: a large fixed cost per call (each op waits for a core), a per-row
    cost, and lognormal noise of ``sigma`` on every call."""
    rng = random.Random(seed)
    return lambda k, i: (fixed + per_row * k) * (rng.lognormvariate(0.0, sigma) if sigma else 1.0)


def test_the_bar_grows_with_the_memory_a_doubling_adds():
    assert host_growth_gain(0, 0, 0) == GROWTH_GAIN            # footprint unknown: the plain rule
    assert host_growth_gain(1 * MiB, 2 * MiB, 2000 * MiB) == pytest.approx(GROWTH_GAIN, abs=1e-3)
    peak = lambda k: MOBILENET_PEAK[0] + MOBILENET_PEAK[1] * k  # noqa: E731
    bars = {k: host_growth_gain(peak(k), peak(2 * k), MOBILENET_FOOTPRINT) for k in (8, 16, 32, 64)}
    assert 0.12 < bars[8] < 0.14 and 0.19 < bars[16] < 0.21 and 0.46 < bars[64] < 0.49, bars
    # the margin is per resident byte: a doubling that adds 8 % to the process must gain 8 % and 5 % more
    assert host_growth_gain(0, 80 * MiB, 1000 * MiB) == pytest.approx(1.05 * 1.08 - 1)
    assert bars[8] < bars[16] < bars[32] < bars[64]


def test_a_gain_must_clear_the_pairs_spread():
    assert host_growth_verdict([(1.0, 0.8), (1.0, 0.8)], gain=0.10) is True       # 25 % twice
    assert host_growth_verdict([(1.0, 0.8)], gain=0.10) is None
    # a median gain of 53 % with a wide spread (one pair 100 %, one 5 %): not proven; a third pair decides
    noisy = [(1.0, 0.5), (1.0, 0.95)]
    assert host_growth_verdict(noisy, gain=0.10) is None
    assert host_growth_verdict(noisy + [(1.0, 0.8)], gain=0.10) is False   # median 25 %, half-range 47 %
    assert host_growth_verdict(noisy + [(1.0, 0.55)], gain=0.10) is True   # median 82 %, half-range 47 %
    assert host_growth_verdict([(1.0, 0.7), (1.0, 0.75), (1.0, 0.8)], gain=0.10) is True
    assert host_growth_verdict([(1.0, 1.0), (1.0, 0.95)], gain=0.10) is False    # a majority short of the bar
    assert next_doubling_gain(0.39) == pytest.approx(0.39 / 1.61) and next_doubling_gain(1.5) == 1.0


def test_a_loaded_hosts_sequence_stops_growing():
    """The hog run: beside 2 CPU hogs each call pays a large fixed cost, so every doubling looked worth 10 %
    and the plain rule grew to 128 rows (a process at 0.96 of the script's RSS). The host rule stops where
    the gain no longer pays for the memory, and never runs a chunk it cannot keep."""
    plain = Ladder(size=8)
    sizes = drive(plain, loaded(), 60, can_grow_to=lambda k: k <= 128)
    assert plain.size == 128 and max(sizes) == 128, sizes
    host = Ladder(size=8, host=True, footprint=MOBILENET_FOOTPRINT)
    sizes = drive(host, loaded(), 60)
    assert host.size == 32 and max(sizes) == 32 and host.is_settled and host.calibrated, sizes
    # with noise on every call (lognormal, 15 % and 30 %; 300 seeds each) the plain rule reaches 128 rows in 40 %
    # or more; the host rule keeps to 32 in 90 % or more and reaches 128 in at most 2 % (seen: 94-96 %, 1 %)
    for sigma in (0.15, 0.30):
        host_largest, plain_largest = [], []
        for seed in range(300):
            ladder = Ladder(size=8, host=True, footprint=MOBILENET_FOOTPRINT)
            host_largest.append(max(drive(ladder, loaded(sigma=sigma, seed=seed), 60)))
            assert ladder.is_settled
            plain_largest.append(max(drive(Ladder(size=8), loaded(sigma=sigma, seed=seed), 60,
                                           can_grow_to=lambda k: k <= 128)))
        assert sum(k <= 32 for k in host_largest) >= 270 and host_largest.count(128) <= 6, (sigma, host_largest)
        assert plain_largest.count(128) >= 120, (sigma, plain_largest)


@pytest.mark.parametrize("gain,grows", [(0.30, True), (0.0, False)])
def test_host_decisions_hold_under_moderate_noise(gain, grows):
    """5 % noise on every call, chunks a sliver of the process: a true 30 % gain grows and no gain does not,
    on at least 96 of 100 seeds, as under the plain rule."""
    wrong = 0
    for seed in range(100):
        rng = random.Random(seed)

        def noisy(k: int, i: int, rng: random.Random = rng) -> float:
            return k / (100.0 * (1 + gain) ** (k > 8)) * rng.lognormvariate(0, 0.05)

        ladder = Ladder(size=8, host=True, footprint=2000 * MiB)
        drive(ladder, noisy, 12, peak_of=lambda k: 1000 * k, can_grow_to=lambda k: k <= 16)
        wrong += (ladder.size == 16) is not grows
    assert wrong <= 4, wrong


def test_a_doubling_that_cannot_pay_is_not_compared():
    """0.1 s + 1 ms a row, chunks a sliver of the process: the plain rule compares 512 with 1024 (9 % more, no)
    and runs 1024-row chunks for it; the host rule knows from 256 -> 512 (16 %) that 1024 can gain 9 % at most."""
    plain = Ladder(size=8)
    assert max(drive(plain, lambda k, i: 0.1 + 0.001 * k, 80)) == 1024 and plain.size == 512
    host = Ladder(size=8, host=True, footprint=2000 * MiB)
    sizes = drive(host, lambda k, i: 0.1 + 0.001 * k, 80, peak_of=lambda k: 1000 * k)
    assert host.size == 512 and max(sizes) == 512 and host.is_settled and 1024 not in host.rejected, sizes
    # a plan's rates say the same before this run measured a doubling (``note_rates``)
    planned = Ladder(size=512, host=True, footprint=2000 * MiB, timed={256, 512}, called={256, 512})
    planned.note_rates({256: 256 / 0.356, 512: 512 / 0.612})
    assert max(drive(planned, lambda k, i: 0.1 + 0.001 * k, 10, peak_of=lambda k: 1000 * k)) == 512


def test_a_real_gain_of_a_fifth_keeps_the_doubled_chunk_on_a_quiet_host(monkeypatch):
    """MobileNetV3Small on the 2-core VMs of 2026-11-26/27: 16-row chunks 10-25 % faster than 8, at ~8 % more of the
    process. A true 22 % gain, 5 % noise on every call, 200 seeds: the doubled chunk is kept in most of them (with
    the margin of GROWTH_GAIN per resident byte, in under half), 32 rows are never kept (the next doubling cannot
    pay for its memory), and no gain at all is still refused (``test_host_decisions_hold_under_moderate_noise``)."""
    from worker.engine import tuning

    def kept_sizes(sigma: float) -> list[int]:
        sizes = []
        for seed in range(200):
            rng = random.Random(seed)
            ladder = Ladder(size=8, host=True, footprint=MOBILENET_FOOTPRINT)
            drive(ladder, lambda k, i, rng=rng: (0.0451 + 0.01 * k) * rng.lognormvariate(0.0, sigma), 60)
            sizes.append(ladder.size)
        return sizes

    now = kept_sizes(0.05)
    assert now.count(16) >= 140 and now.count(32) == 0, now
    monkeypatch.setattr(tuning, "HOST_MARGIN", GROWTH_GAIN)
    before = kept_sizes(0.05)
    assert before.count(16) < 110, before



@pytest.mark.parametrize("host, footprint, added, want", [
    (False, 0, 10 << 30, tuning.EXPECTED_GAIN),        # a GPU job: its pool is the planner's; later jobs count fully
    (True, 1 << 30, 1 << 20, tuning.EXPECTED_GAIN),     # a host job whose doubling adds 0.1 % of the process
    (True, 1 << 30, 200 << 20, tuning.GROWTH_GAIN),     # MobileNet's 16 -> 32 rows: +20 % of the process's peak
    (True, 0, 1 << 20, tuning.GROWTH_GAIN),             # footprint unknown: the plain rule
])
def test_later_jobs_repay_a_new_size_at_a_trial_s_gain_unless_it_raises_the_host_peak(host, footprint, added, want):
    assert tuning.later_jobs_gain(100 << 20, (100 << 20) + added, footprint, host=host) == want
