"""``app.heatmap``: block means read chunk by chunk equal a dense reference; PNG round trip; colours."""

from __future__ import annotations

import math

import numpy as np
import pytest
import zarr

from app.heatmap import block_mean, decode_png, diverging, encode_png, render
from app.routes.preview import matrix_axes, render_preview


def dense_block_mean(a: np.ndarray, row_axes: int, batch: bool, max_panels: int, max_side: int) -> np.ndarray:
    a = a[:max_panels] if batch else a[None]
    rows, cols = math.prod(a.shape[1:1 + row_axes]), math.prod(a.shape[1 + row_axes:])
    m = a.reshape(a.shape[0], rows, cols).astype(np.float64)
    h, w = min(rows, max_side), min(cols, max_side)
    rb, cb = np.arange(rows) * h // rows, np.arange(cols) * w // cols
    out = np.zeros((a.shape[0], h, w))
    np.add.at(out, (slice(None), rb[:, None], cb[None, :]), m)
    return out / np.outer(np.bincount(rb), np.bincount(cb))


@pytest.mark.parametrize("shape, chunks, row_axes, batch, side", [
    ((6, 5, 7, 3), (2, 5, 3, 3), 2, False, 4),     # chunks across row and column axes
    ((6, 5, 7, 3), (1, 2, 7, 3), 1, True, 3),      # batch panels, first 4 of 6
    ((30, 40), (7, 40), 1, False, 512),            # no downsampling
    ((30, 40), (30, 9), 1, False, 8),              # column chunks (forward mode layout)
    ((3, 4, 2, 5), (3, 4, 1, 5), 2, False, 5),
    ((700, 3), (64, 3), 1, False, 512),            # uneven bins
])
def test_block_mean_equals_dense_reference(tmp_path, shape, chunks, row_axes, batch, side):
    a = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    z = zarr.create_array(str(tmp_path / "a.zarr"), shape=shape, chunks=chunks, dtype="float32")
    z[...] = a
    ds = block_mean(z, row_axes=row_axes, batch=batch, max_side=side)
    np.testing.assert_allclose(ds.panels, dense_block_mean(a, row_axes, batch, 4, side), rtol=1e-6, atol=1e-6)
    shown = a[:4] if batch else a
    assert ds.raw_min == shown.min() and ds.raw_max == shown.max()


def test_png_round_trip_and_colours():
    img = np.random.default_rng(1).integers(0, 256, size=(7, 11, 3), dtype=np.uint8)
    assert (decode_png(encode_png(img)) == img).all()
    rgb = diverging(np.array([-2.0, -1.0, 0.0, 1.0, np.nan]), 1.0)
    assert tuple(rgb[2]) == (255, 255, 255)             # zero is white
    assert rgb[1][2] > rgb[1][0] and rgb[3][0] > rgb[3][2]  # negative blue, positive red
    assert (rgb[0] == rgb[1]).all()                      # clipped at the limit
    assert tuple(rgb[4]) == (160, 160, 160)              # NaN grey


def test_matrix_axes_from_attributes():
    assert matrix_axes("jacobian", (2, 4, 2, 8), {"of_shape": [2, 4], "wrt_shape": [2, 8]}) == (False, 2)
    assert matrix_axes("batch_jacobian", (5, 4, 8), {"of_shape": [5, 4], "wrt_shape": [5, 8]}) == (True, 1)
    assert matrix_axes("hessian", (3, 2, 3, 2), {"of_shape": [], "wrt_shape": [3, 2]}) == (False, 2)
    assert matrix_axes("jacobian", (4, 6), {}) == (False, 1)


def test_render_preview_of_a_stored_array(tmp_path):
    a = np.zeros((3, 4, 3, 5), np.float32)
    for i in range(3):
        a[i, :, i, :] = np.linspace(-1, 2, 20).reshape(4, 5)
    z = zarr.create_array(str(tmp_path / "j.zarr"), shape=a.shape, chunks=(1, 4, 3, 5), dtype="float32",
                          attributes={"kind": "jacobian", "of": "y", "wrt": "x", "of_shape": [3, 4],
                                      "wrt_shape": [3, 5]})
    z[...] = a
    png, headers = render_preview(z, kind=None, panels=4, size=512)
    assert headers == {"X-Preview-Matrix": "12x15", "X-Preview-Cells": "12x15", "X-Preview-Panels": "1/1"}
    img = decode_png(png)
    assert img.ndim == 3 and img.shape[1] > 400
    assert ((img[..., 0] > 150) & (img[..., 2] < 110)).any() and ((img[..., 2] > 150) & (img[..., 0] < 110)).any()
    ds = block_mean(z, row_axes=2, max_side=4)
    assert ds.panels.shape == (1, 4, 4)
    assert render(ds, title="T").startswith(b"\x89PNG")
