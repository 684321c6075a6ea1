"""Host peaks the allocator statistics miss (worker.engine.host_peak): a ``loop`` chunk of an LSTM reads 0 bytes
by TensorFlow's CPU allocator; a host job records the process's RSS delta (VmHWM) instead, and says so."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from tests.engine.conftest import rand
from worker.engine import RunOptions, TFMemoryProbe, build_problem, host_peak, load_model, run_problem
from worker.engine.host_peak import ResidentPeak

MiB = 1 << 20


def linux_peak_or_skip() -> None:
    """Skip loudly where /proc cannot reset and read the peak resident set (not Linux, a locked-down /proc)."""
    probe = ResidentPeak()
    probe.start()
    if platform.system() != "Linux" or probe.delta() is None:
        pytest.skip(f"no resettable VmHWM here ({platform.system()}; {host_peak.CLEAR_REFS} not writable or "
                    f"{host_peak.STATUS} unreadable): the RSS peak cannot be measured")


def test_the_resident_peak_sees_memory_touched_and_freed_within_the_span():
    linux_peak_or_skip()
    probe = ResidentPeak()
    probe.start()
    block = np.ones(64 * MiB, np.uint8)   # 64 MiB, every page touched, freed before the reading
    del block
    delta = probe.delta()
    assert delta is not None and 60 * MiB <= delta <= 200 * MiB, delta
    probe.start()                          # a new span: the last one's peak is forgotten
    assert probe.delta() < 32 * MiB


def test_unreadable_proc_files_measure_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(host_peak, "CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    probe = ResidentPeak()
    probe.start()
    assert probe.delta() is None and not probe.available
    monkeypatch.setattr(host_peak, "STATUS", str(tmp_path / "status"))
    (tmp_path / "status").write_text("Name: x\n")
    assert host_peak.resident_bytes() is None and host_peak.status_bytes("VmHWM") is None


@pytest.fixture(scope="module")
def lstm(tmp_path_factory):
    """Keras LSTM (not unrolled: a ``While`` op) with a dense head per step: ``x`` (1, 30, 8) -> ``y`` (1, 30, 4)."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((30, 8), name="x")
    h = keras.layers.LSTM(32, return_sequences=True, unroll=False)(x)
    path = tmp_path_factory.mktemp("lstm") / "lstm"
    keras.Model(x, {"y": keras.layers.Dense(4)(h)}).export(str(path), verbose=False)
    return load_model(str(path))


def _loop_run_in_this_process(path: str) -> dict:
    """Run ``loop`` over the LSTM at ``path``; what the plan learned of it (for a fresh process to return)."""
    model = load_model(path)
    problem = build_problem(model, {"x": rand((1, 30, 8))})
    report = run_problem(problem, probe=TFMemoryProbe("CPU:0"), options=RunOptions(strategy="loop"))
    record = report.learned.record("loop")
    largest = max(record.peaks) if record.peaks else None
    return {"rows": (report.rows_computed, problem.rows_total), "measure": record.peak_measure,
            "peaks": dict(record.peaks), "line_at_largest": record.memory(largest) if record.memory else None,
            "json_measure": report.learned.to_json()["strategies"]["loop"]["peak_measure"]}


def test_a_loop_strategys_peak_is_the_process_rss_delta(lstm):
    """The allocator reads ~0 for ``loop`` chunks; the plan's peaks are the RSS delta, marked as such, and its
    memory line is drawn through them (a quote then has a real figure).

    In a fresh process, as a job's: one that has run a thousand tests holds partly used heap pages that a
    trim cannot return, and an LSTM chunk's few hundred KiB then land in them (CI read 252 KiB at 16 rows
    there, against 1.2-2.1 MiB in a fresh process; untrimmed, a fresh process read 0.0-0.7 MiB)."""
    import multiprocessing

    linux_peak_or_skip()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        run = pool.apply(_loop_run_in_this_process, (lstm.path,))
    assert run["rows"] == (120, 120)
    assert run["measure"] == run["json_measure"] == "process_rss", run
    peaks = run["peaks"]
    # every size, not only a first call that traced: the heap is trimmed before each chunk
    assert peaks and min(peaks.values()) >= 512 * 1024, peaks
    assert run["line_at_largest"] is not None and run["line_at_largest"] >= max(peaks.values()), run


def test_without_proc_a_loop_run_keeps_the_allocators_figures(lstm, monkeypatch, tmp_path):
    monkeypatch.setattr(host_peak, "CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    problem = build_problem(lstm, {"x": rand((1, 30, 8))})
    report = run_problem(problem, probe=TFMemoryProbe("CPU:0"), options=RunOptions(strategy="loop"))
    assert report.rows_computed == 120 and report.learned.record("loop").peak_measure == "allocator"


def test_a_strategy_whose_allocator_peak_is_below_its_own_result_is_measured_by_rss(lstm):
    """``tiled`` on the LSTM: its chunks' allocations are each under the allocator's counting threshold, so the
    first chunk reads less than the rows it returns; from the next chunk on the plan records RSS deltas."""
    linux_peak_or_skip()
    problem = build_problem(lstm, {"x": rand((1, 30, 8))})
    report = run_problem(problem, probe=TFMemoryProbe("CPU:0"), options=RunOptions(strategy="tiled"))
    record = report.learned.record("tiled")
    assert record.peak_measure == "process_rss" and max(record.peaks.values()) >= 256 * 1024, record.peaks


class GPUProbe(TFMemoryProbe):
    """The real probe, said to be a GPU's: no host peaks, no host growth rule."""

    @property
    def is_gpu(self) -> bool:
        return True


def test_only_host_jobs_measure_rss_and_weigh_memory_in_growth(lstm):
    from worker.engine.chunk_run import ChunkRun
    from worker.engine.plan import Plan

    problem = build_problem(lstm, {"x": rand((1, 30, 8))})
    options = dict(budget=None, chunk_rows=None, throughput_cap=True, refine="never", try_xla=False, pinned=True,
                   on_plan=None)
    gpu = ChunkRun(problem, Plan(strategy="loop"), GPUProbe("CPU:0"), **options)
    assert gpu.host is None and not gpu.ladder("loop").host and gpu.ladder("loop").footprint == 0
    host = ChunkRun(problem, Plan(strategy="loop"), TFMemoryProbe("CPU:0"), **options)
    ladder = host.ladder("loop")
    assert host.host is not None and ladder.host
    if platform.system() == "Linux":
        assert ladder.footprint > 50 * MiB   # TensorFlow and the model are resident


def test_a_settled_size_reads_the_process_peak_now_and_then_not_every_chunk(lstm, monkeypatch):
    """A reading trims the heap and the chunk faults its pages in again (MobileNetV3Small: a quarter of an 8-row
    chunk's time), so 60 chunks of a pinned size are read on their first two and every sixteenth after them; the
    job still has their peak."""
    linux_peak_or_skip()
    starts = []
    real = ResidentPeak.start
    monkeypatch.setattr(ResidentPeak, "start", lambda self: (starts.append(1), real(self))[1])
    problem = build_problem(lstm, {"x": rand((1, 30, 8))})
    report = run_problem(problem, probe=TFMemoryProbe("CPU:0"), options=RunOptions(strategy="tiled", chunk_rows=2))
    record = report.learned.record("tiled")
    assert report.rows_computed == 120 and record.peak_measure == "process_rss" and report.peak_bytes > 0
    # one when the job starts, then chunks 2-3 (the first traces; the second tells that the allocator misses
    # them), and the pinned size's readings 0, 1, 16, 32, 48 of the 58 left
    assert len(starts) <= 8, len(starts)


def test_a_trials_calls_are_all_read_so_that_both_sides_are_timed_alike(lstm, monkeypatch):
    """In a trial the incumbent's size is settled, but its calls are timed against the candidate's, which are
    read: the incumbent's are read too (an unread chunk runs faster by what a reading costs)."""
    from worker.engine.chunk_run import ChunkRun
    from worker.engine.plan import Plan
    from worker.engine.trial import maybe_trial

    linux_peak_or_skip()
    problem = build_problem(lstm, {"x": rand((1, 30, 8))})
    run = ChunkRun(problem, Plan(strategy="tiled"), TFMemoryProbe("CPU:0"), budget=None, chunk_rows=None,
                   throughput_cap=True, refine="always", try_xla=False, pinned=False, on_plan=None)
    decided = []
    real = run.host.before
    monkeypatch.setattr(run.host, "before", lambda record, **kw: (decided.append((kw["size"], kw["decides"])),
                                                                  real(record, **kw))[1])
    for _ in range(3):   # the incumbent's size, read on its first chunks, then settled
        rows, seconds, peak, first = run.call("tiled", 0, 4)
        run.measured("tiled", 4, seconds, peak, first, 100, warm=not first)
    run.ladders["tiled"].comparison, run.ladders["tiled"].growing = None, False
    run.last = (0, rows, "tiled", peak)
    decided.clear()
    maybe_trial(run, ["tiled", "vectorized"], rows_left=100, seconds_per_row=seconds / 4)
    assert run.status["trial"]["candidate"] == "vectorized" and not run.in_trial
    incumbent = [d for size, d in decided if size[0] == "tiled"]
    assert incumbent and all(incumbent), decided


def test_freeze_imports_leaves_what_jobs_make_collectable():
    """``freeze_imports`` (a fresh process: the freeze is for the process's life) imports TensorFlow and the modules
    named and puts their objects out of the collector's reach, once, the collector on again after; a reference
    cycle made after it is still collected, and a full collection walks only what was made since (far fewer
    objects than TensorFlow's modules hold)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import gc, sys, weakref
        from worker.engine.host_peak import freeze_imports
        assert "tensorflow" not in sys.modules
        freeze_imports("worker.execution.dense")
        frozen = gc.get_freeze_count()
        assert "tensorflow" in sys.modules and "worker.execution.dense" in sys.modules
        assert gc.isenabled(), "the collector was left off"
        freeze_imports()
        assert gc.get_freeze_count() == frozen, (gc.get_freeze_count(), frozen)
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None, "a cycle made after the freeze was not collected"
        print(frozen, len(gc.get_objects()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    frozen, tracked = map(int, out.stdout.split())
    assert frozen > 100_000 and tracked < frozen // 10, (frozen, tracked)
