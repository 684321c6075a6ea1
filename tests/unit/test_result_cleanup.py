"""Removing a job's result on local disk: the partial result (array, markers) or the whole job folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from contracts import storage
from contracts.layout import INPUTS, ResultLayout
from worker.storage import ResultWriter, RetryPolicy


def written_job(results: Path, job_id: str) -> Path:
    """A job folder with inputs, a 3-block array and its commit markers (no manifest)."""
    storage.write_bytes(str(results / job_id / INPUTS), b"npz")
    layout = ResultLayout(shape=(6, 5), iter_start=0, iter_stop=1, itemsize=4, block_bytes=40)
    with ResultWriter(str(results), job_id, layout=layout, dtype="float32", retry=RetryPolicy(attempts=1)) as w:
        w.write_rows(0, np.ones((6, 5), np.float32))
    assert sorted(p.name for p in (results / job_id).iterdir()) == ["committed", INPUTS, "result.zarr"]
    return results / job_id


def test_remove_partial_result_keeps_the_inputs(tmp_path: Path) -> None:
    from worker.result_group import remove_partial_result

    job = written_job(tmp_path, "j1")
    other = written_job(tmp_path, "j2")
    remove_partial_result(f"file://{tmp_path}", "j1")
    assert sorted(p.name for p in job.iterdir()) == [INPUTS]
    assert sorted(p.name for p in other.iterdir()) == ["committed", INPUTS, "result.zarr"]
    remove_partial_result(str(tmp_path), "j1")  # nothing left to remove: not an error
    remove_partial_result(str(tmp_path), "never-ran")


def test_remove_job_result_removes_the_job_folder_only(tmp_path: Path) -> None:
    from worker.result_group import remove_job_result

    written_job(tmp_path, "j1")
    other = written_job(tmp_path, "j2")
    remove_job_result(str(tmp_path), "j1")
    assert not (tmp_path / "j1").exists() and (other / INPUTS).is_file()
    remove_job_result(str(tmp_path), "j1")  # nothing there: not an error


def test_removal_raises_oserror_when_storage_fails(tmp_path: Path, monkeypatch) -> None:
    from worker.result_group import remove_job_result, remove_partial_result

    written_job(tmp_path, "j1")

    def failing(url: str) -> None:
        raise PermissionError(f"denied: {url}")

    monkeypatch.setattr(storage, "delete_prefix", failing)
    for remove in (remove_partial_result, remove_job_result):
        with pytest.raises(OSError, match="denied"):
            remove(str(tmp_path), "j1")
