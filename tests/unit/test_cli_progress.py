"""The client commands that wait on a job (``jacobian submit --wait``, ``jacobian status --wait``) against a
fake API: progress on stderr (a tqdm bar on a terminal, plain lines otherwise), the id or the record alone on stdout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from jacobian import cli, cli_client
from jacobian.client import JacobianClient
from tests.unit.fake_tty import FakeTTY, plain_lines

JOB = "c" * 32


def _record(status: str, done: int, total: int | None, rate: float | None = None) -> dict:
    progress = {"rows_done": done, "rows_total": total, "fraction": done / total if total else 0.0,
                "rows_per_second": rate, "eta_seconds": (total - done) / rate if rate and total else None}
    return {"id": JOB, "status": status, "progress": progress,
            "plan": {"strategy": "vectorized"} if status != "queued" else {},
            "result": {"uri": "/r/jacobian.zarr", "shape": [4, 4, 4, 8], "dtype": "float32"}
            if status == "succeeded" else None,
            "error": None, "created_at": "2026-01-01T00:00:00.000Z", "started_at": None, "finished_at": None,
            "kind": "jacobian", "model": {"path": "/models/mlp", "signature": "serving_default"}}


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """An API whose job goes queued -> running (8, then 16 rows of 16) -> succeeded, one step per poll."""
    steps: Iterator[dict] = iter([_record("queued", 0, None), _record("running", 8, 16, 40.0),
                                  _record("running", 16, 16, 40.0)])
    done = _record("succeeded", 16, 16, 40.0)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, json={"id": JOB, "status": "queued"})
        return httpx.Response(200, json=next(steps, done))

    monkeypatch.setattr(cli_client, "_client",
                        lambda args: JacobianClient("http://api", transport=httpx.MockTransport(handler)))


def test_submit_wait_on_a_terminal_draws_a_bar_and_prints_only_the_id_on_stdout(fake_api, tmp_path, monkeypatch,
                                                                                capsys):
    np.savez(tmp_path / "x.npz", x=np.zeros((4, 8), np.float32))
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    code = cli.main(["submit", "--model", "mlp", "--input", str(tmp_path / "x.npz"), "--wait", "--poll", "0"])
    assert code == 0
    assert capsys.readouterr().out == f"{JOB}\n"
    text = tty.getvalue()
    bar, done = text.rsplit("\n", 2)[:2]
    last = bar.split("\r")[-1]
    assert last.startswith("100.0%|") and "rows 16/16" in last and "40.00 rows/s" in last, text
    assert "succeeded, strategy vectorized" in last
    assert done == f"succeeded: {JOB} shape [4, 4, 4, 8] float32 at /r/jacobian.zarr"


def test_status_wait_in_a_log_prints_plain_lines_and_the_record_alone_on_stdout(fake_api, capsys):
    code = cli.main(["status", JOB, "--wait", "--poll", "0"])
    assert code == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "succeeded"
    lines = plain_lines(captured.err)
    assert lines[0].startswith("rows 0/?, ? rows/s") and lines[0].endswith("queued")
    assert lines[1].startswith("rows 8/16 (50.0%), 40.00 rows/s, eta 00:00")
    assert lines[-2].startswith("rows 16/16 (100.0%)") and lines[-2].endswith("succeeded, strategy vectorized")
    assert lines[-1].startswith(f"succeeded: {JOB} ")


def test_quiet_wait_prints_no_progress(fake_api, capsys):
    assert cli.main(["status", JOB, "--wait", "--quiet", "--poll", "0"]) == 0
    assert capsys.readouterr().err.startswith(f"succeeded: {JOB} ")
