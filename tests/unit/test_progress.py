"""CLI progress (``jacobian.progress``, drawn by tqdm): a live bar on a terminal, plain lines in logs and pipes."""

from __future__ import annotations

import io

from jacobian.progress import RowProgress, is_terminal
from tests.unit.fake_tty import Clock, FakeTTY, plain_lines

# -- the two modes -----------------------------------------------------------------------------------


def test_on_a_terminal_a_tqdm_bar_is_redrawn_in_place_and_ends_full():
    out = FakeTTY()
    assert is_terminal(out) and not is_terminal(io.StringIO())
    with RowProgress(out, state="strategy vectorized") as progress:
        assert progress.terminal
        for done in range(0, 17, 4):
            progress.update(done, 16, rate=8.0, eta=(16 - done) / 8.0)
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1  # one line, redrawn
    frames = [frame for frame in text.rstrip("\n").split("\r") if frame]
    assert "rows 0/16" in frames[0] and "8.00 rows/s" in frames[-1] and "strategy vectorized" in frames[-1]
    last = frames[-1]
    assert last.startswith("100.0%|") and "rows 16/16" in last and "<00:00," in last  # ETA 0 at the end
    bar = last.split("|")[1]
    assert len(bar) >= 10 and set(bar) <= set("#█"), last  # a full bar


def test_on_a_terminal_a_note_prints_above_the_bar_which_is_redrawn():
    out = FakeTTY()
    with RowProgress(out) as progress:
        progress.update(2, 8, rate=4.0)
        progress.note("plan: {'strategy': 'tiled'}")
        progress.update(8, 8, rate=4.0)
    text = out.getvalue()
    before, after = text.split("plan: {'strategy': 'tiled'}\n")
    assert "rows 2/8" in before and "rows 2/8" in after and "rows 8/8" in after.split("\r")[-1]


def test_in_a_log_plain_lines_come_every_period_with_rows_done_of_total_and_a_last_one():
    out, clock = io.StringIO(), Clock()
    progress = RowProgress(out, every_s=10.0, clock=clock, state="strategy vectorized")
    assert not progress.terminal
    for done in range(0, 100):  # one row a second, reported every second
        progress.update(done, 100, rate=1.0, eta=100.0 - done)
        clock.t += 1.0
    progress.update(100, 100, rate=1.0, eta=0.0)
    progress.close()
    lines = plain_lines(out.getvalue())
    assert [line.split(",")[0] for line in lines] == [f"rows {d}/100 ({d:.1f}%)" for d in range(0, 100, 10)] + [
        "rows 100/100 (100.0%)"]
    assert lines[1] == "rows 10/100 (10.0%), 1.00 rows/s, eta 01:30, elapsed 00:10, strategy vectorized"
    assert lines[-1] == "rows 100/100 (100.0%), 1.00 rows/s, eta 00:00, elapsed 01:40, strategy vectorized"


def test_in_a_log_a_new_state_prints_at_once_and_close_prints_the_last_state_once():
    out, clock = io.StringIO(), Clock()
    progress = RowProgress(out, every_s=10.0, clock=clock)
    progress.update(0, None, state="queued")
    clock.t += 1
    progress.update(0, 16, state="running")  # new state and total: at once
    clock.t += 1
    progress.update(4, 16, state="running")  # within the period: not yet
    clock.t += 1
    progress.update(5, 16, state="failed")
    progress.close()
    progress.close()
    lines = plain_lines(out.getvalue())
    assert lines == ["rows 0/?, ? rows/s, eta ?, elapsed 00:00, queued",
                     "rows 0/16 (0.0%), ? rows/s, eta ?, elapsed 00:01, running",
                     "rows 5/16 (31.2%), 1.67 rows/s, eta 00:06, elapsed 00:03, failed"]  # rate measured here


def test_in_a_log_close_prints_an_update_not_shown_yet():
    out, clock = io.StringIO(), Clock()
    with RowProgress(out, every_s=10.0, clock=clock) as progress:
        progress.update(10, 1000)
        clock.t += 2
        progress.update(30, 1000, rate=10.0)
    lines = plain_lines(out.getvalue())
    assert lines == ["rows 10/1000 (1.0%), ? rows/s, eta ?, elapsed 00:00",
                     "rows 30/1000 (3.0%), 10.00 rows/s, eta 01:37, elapsed 00:02"]


def test_disabled_progress_writes_nothing():
    for out in (FakeTTY(), io.StringIO()):
        with RowProgress(out, enabled=False) as progress:
            progress.update(3, 4)
            progress.note("plan")
        assert out.getvalue() == ""
