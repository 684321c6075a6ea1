"""The precision guard's float64 rows kept across processes (worker.execution.reference_rows): keys and files."""

from __future__ import annotations

import numpy as np

from worker.execution import reference_rows

X = np.arange(12, dtype=np.float64).reshape(2, 6)
REQUEST = {"kind": "jacobian", "of": "y", "wrt": "x", "mode": "auto", "reduce": None, "rows": None}


def _key(**change):
    args = {"fingerprint": "abc", "signature": "serving_default", "request": REQUEST, "product": "vjp",
            "probes": 3, "seed": 27, "inputs": {"x": X}, **change}
    return reference_rows.key(**args)


def test_the_key_follows_everything_the_rows_depend_on():
    base = _key()
    assert base == _key(inputs={"x": X.copy()})   # the inputs' bytes, not their identity
    changed = [_key(fingerprint="abd"), _key(signature="other"), _key(request={**REQUEST, "of": "z"}),
               _key(request={**REQUEST, "rows": [0, 4]}), _key(product="hvp"), _key(probes=4), _key(seed=28),
               _key(inputs={"x": X + 1e-12}), _key(inputs={"x": X.astype(np.float32)}),
               _key(inputs={"x": X.reshape(3, 4)}), _key(inputs={"x2": X}), _key(inputs={"x": X, "y": X})]
    assert len({base, *changed}) == len(changed) + 1


def test_rows_kept_are_read_back_and_a_damaged_file_is_a_miss(tmp_path):
    picked, want = np.array([1, 5, 7]), np.random.default_rng(0).standard_normal((3, 6))
    assert reference_rows.load(str(tmp_path), "k") is None
    reference_rows.store(str(tmp_path), "k", picked, want, (2, 4))
    got = reference_rows.load(str(tmp_path), "k")
    assert got is not None and np.array_equal(got[0], picked) and np.array_equal(got[1], want) and got[2] == (2, 4)
    (tmp_path / "references" / "k.npz").write_bytes(b"not an npz")
    assert reference_rows.load(str(tmp_path), "k") is None
    reference_rows.store(str(tmp_path), "k", picked, want[:2], (2, 4))   # rows that do not match the picks
    assert reference_rows.load(str(tmp_path), "k") is None
    reference_rows.store(None, "k", picked, want, (2, 4))   # no cache folder, no key: nothing kept
    assert reference_rows.load(None, "k") is None and reference_rows.load(str(tmp_path), None) is None


def test_the_folder_keeps_the_most_recently_used_files_within_its_bounds(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(reference_rows, "MAX_FILES", 3)
    picked, want = np.array([0]), np.zeros((1, 4))
    for i in range(3):
        reference_rows.store(str(tmp_path), f"k{i}", picked, want, (1,))
        os.utime(tmp_path / "references" / f"k{i}.npz", (1000 + i, 1000 + i))
    assert reference_rows.load(str(tmp_path), "k0") is not None   # read: now the most recent
    reference_rows.store(str(tmp_path), "k3", picked, want, (1,))
    assert sorted(p.stem for p in (tmp_path / "references").glob("*.npz")) == ["k0", "k2", "k3"]
    big = np.zeros((1, reference_rows.MAX_ROWS_BYTES // 8 + 1))
    reference_rows.store(str(tmp_path), "big", picked, big, (1,))   # too large to keep
    assert reference_rows.load(str(tmp_path), "big") is None
