"""``app.heatmap``: block means read chunk by chunk equal a dense reference; the matplotlib heatmap's
PNG (decoded with Pillow): its size, colours centred on zero where the values are, batch panels, NaN/inf."""

from __future__ import annotations

import io
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from PIL import Image

from app import plots
from app.heatmap import Downsampled, MatrixAxis, block_mean, colour_limit, heatmap_figure
from app.routes.preview import matrix_axes, render_preview

REPO = Path(__file__).resolve().parents[2]


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


def test_matrix_axes_from_attributes():
    assert matrix_axes("jacobian", (2, 4, 2, 8), {"of_shape": [2, 4], "wrt_shape": [2, 8]}) == (False, 2)
    assert matrix_axes("batch_jacobian", (5, 4, 8), {"of_shape": [5, 4], "wrt_shape": [5, 8]}) == (True, 1)
    assert matrix_axes("hessian", (3, 2, 3, 2), {"of_shape": [], "wrt_shape": [3, 2]}) == (False, 2)
    assert matrix_axes("jacobian", (4, 6), {}) == (False, 1)


def decode(png: bytes) -> np.ndarray:
    """A PNG as ``(h, w, 3)`` uint8 RGB, checked by Pillow first."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    Image.open(io.BytesIO(png)).verify()
    with Image.open(io.BytesIO(png)) as img:
        assert img.format == "PNG"
        return np.asarray(img.convert("RGB"))


def is_red(px: np.ndarray) -> bool:
    r, g, b = (int(c) for c in px)
    return r > b + 60 and r > g + 60


def is_blue(px: np.ndarray) -> bool:
    r, g, b = (int(c) for c in px)
    return b > r + 60 and b > g


def is_white(px: np.ndarray) -> bool:
    return bool((px > 235).all())


def pixel(img: np.ndarray, ax, fx: float, fy: float) -> np.ndarray:
    """The pixel at fractions ``(fx, fy)`` of axes ``ax``, from its top-left corner."""
    box = ax.get_position()  # figure fractions, from the bottom left
    h, w = img.shape[:2]
    x = (box.x0 + fx * box.width) * w
    y = (1.0 - (box.y1 - fy * box.height)) * h
    return img[int(y), int(x)]


@pytest.fixture
def figures(monkeypatch):
    """The figures ``render_preview`` draws, in order (their PNGs are still made)."""
    drawn = []
    real = plots.figure_to_png

    def keep(fig):
        drawn.append(fig)
        return real(fig)

    monkeypatch.setattr(plots, "figure_to_png", keep)
    return drawn


def test_colours_are_centred_on_zero_where_the_values_are():
    m = np.zeros((20, 30))
    m[:10, :15] = 2.0       # top left: red
    m[:10, 15:] = -1.0      # top right: blue, not as dark
    m[10:, 15:] = np.nan    # bottom right: grey; bottom left stays 0: white
    ds = Downsampled(m[None], 20, 30, raw_min=-1.0, raw_max=2.0)
    fig = heatmap_figure(ds, title="T", subtitle="S", row_axis=MatrixAxis("y", (20,)),
                         col_axis=MatrixAxis("x", (2, 15)), value_label="dy/dx")
    img = decode(plots.figure_to_png(fig))
    assert img.shape == (round(fig.get_figheight() * plots.DPI), round(fig.get_figwidth() * plots.DPI), 3)
    panel, bar = fig.axes
    assert is_red(pixel(img, panel, 0.25, 0.25)) and is_blue(pixel(img, panel, 0.75, 0.25))
    assert is_white(pixel(img, panel, 0.25, 0.75))
    assert tuple(pixel(img, panel, 0.75, 0.75)) == (160, 160, 160)
    assert pixel(img, panel, 0.75, 0.25)[0] > 90   # -1 of a scale at +-2: a lighter blue
    assert is_red(pixel(img, bar, 0.5, 0.02)) and is_blue(pixel(img, bar, 0.5, 0.98))
    assert is_white(pixel(img, bar, 0.5, 0.5))      # zero in the middle of the bar
    assert bar.get_ylim() == (-2.0, 2.0) and 0.0 in bar.get_yticks()
    assert list(panel.get_xticks()) == [0, 15]       # the first element of each entry of x's leading axis
    texts = [t.get_text() for t in fig.texts]
    assert "T" in texts and "S" in texts and "rows: y, shape (20,)" in texts
    assert "columns: x, shape (2, 15), flattened to 30" in texts
    assert any("min -1" in t and "max 2" in t and "NaN/inf" in t for t in texts)


def test_render_preview_of_a_stored_array(tmp_path, figures):
    a = np.zeros((3, 4, 3, 5), np.float32)
    for i in range(3):
        a[i, :, i, :] = np.linspace(-1, 2, 20).reshape(4, 5)
    z = zarr.create_array(str(tmp_path / "j.zarr"), shape=a.shape, chunks=(1, 4, 3, 5), dtype="float32",
                          attributes={"kind": "jacobian", "of": "y", "wrt": "x", "of_shape": [3, 4],
                                      "wrt_shape": [3, 5]})
    z[...] = a
    png, headers = render_preview(z, kind=None, panels=4, size=512, job_id="abc123")
    assert headers == {"X-Preview-Matrix": "12x15", "X-Preview-Cells": "12x15", "X-Preview-Panels": "1/1"}
    img = decode(png)
    assert img.shape[1] > 400 and img.shape[0] > 300
    (fig,) = figures
    panel = fig.axes[0]
    assert is_blue(pixel(img, panel, 0.5 / 15, 0.5 / 12))        # a[0, 0, 0, 0] = -1
    assert is_red(pixel(img, panel, 14.5 / 15, 11.5 / 12))       # a[2, 3, 2, 4] = 2
    assert is_white(pixel(img, panel, 14.5 / 15, 0.5 / 12))      # off the diagonal blocks: 0
    texts = " | ".join(t.get_text() for t in fig.texts)
    assert "Jacobian ∂y/∂x" in texts and "job abc123" in texts and "(3, 4, 3, 5): 12 × 15" in texts
    assert "rows: y, shape (3, 4), flattened to 12" in texts and "columns: x, shape (3, 5), flattened to 15" in texts


def test_a_downsampled_preview_says_so(tmp_path, figures):
    z = zarr.create_array(str(tmp_path / "big.zarr"), shape=(300, 200), chunks=(64, 200), dtype="float32",
                          attributes={"kind": "jacobian", "of": "y", "wrt": "x"})
    z[...] = np.random.default_rng(2).normal(size=(300, 200)).astype(np.float32)
    png, headers = render_preview(z, kind=None, panels=4, size=50)
    assert headers["X-Preview-Cells"] == "50x50" and headers["X-Preview-Matrix"] == "300x200"
    decode(png)
    texts = " | ".join(t.get_text() for t in figures[0].texts)
    assert "means of 6 × 4 blocks" in texts


def test_batch_jacobian_one_panel_per_example_first_n_of_m(tmp_path, figures):
    signs = np.array([1, -1, 1, -1, 1, -1], np.float32)
    a = signs[:, None, None] * np.ones((6, 4, 5), np.float32)
    z = zarr.create_array(str(tmp_path / "b.zarr"), shape=a.shape, chunks=(2, 4, 5), dtype="float32",
                          attributes={"kind": "batch_jacobian", "of": "y", "wrt": "x", "of_shape": [6, 4],
                                      "wrt_shape": [6, 5]})
    z[...] = a
    png, headers = render_preview(z, kind=None, panels=4, size=512)
    assert headers == {"X-Preview-Matrix": "4x5", "X-Preview-Cells": "4x5", "X-Preview-Panels": "4/6"}
    img = decode(png)
    (fig,) = figures
    *panels, bar = fig.axes
    assert [ax.get_title() for ax in panels] == [f"example {i}" for i in range(4)]
    assert len({round(ax.get_position().x0, 3) for ax in panels}) == 4   # side by side
    for i, ax in enumerate(panels):
        assert (is_red if signs[i] > 0 else is_blue)(pixel(img, ax, 0.5, 0.5)), i
    texts = " | ".join(t.get_text() for t in fig.texts)
    assert "Batch Jacobian ∂y[i]/∂x[i]" in texts and "first 4 of 6 examples" in texts
    assert "rows: y[i], shape (4,)" in texts and "columns: x[i], shape (5,)" in texts

    figures.clear()
    render_preview(z, kind=None, panels=16, size=512)
    assert len(figures[0].axes) == 6 + 1 and "6 examples" in " ".join(t.get_text() for t in figures[0].texts)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf, "all-nan", "all-zero"])
def test_nan_inf_and_constant_results_render(tmp_path, figures, fill):
    a = np.zeros((6, 8), np.float32) if fill == "all-zero" else np.full((6, 8), np.nan, np.float32)
    if not isinstance(fill, str):
        a = np.arange(48, dtype=np.float32).reshape(6, 8) - 20
        a[2, 3] = fill
    z = zarr.create_array(str(tmp_path / "n.zarr"), shape=a.shape, chunks=(3, 8), dtype="float32",
                          attributes={"kind": "jacobian", "of": "y", "wrt": "x"})
    z[...] = a
    png, _ = render_preview(z, kind=None, panels=4, size=512)
    img = decode(png)
    footer = " | ".join(t.get_text() for t in figures[0].texts)
    if fill == "all-nan":
        assert "no finite values" in footer
    elif fill == "all-zero":
        assert "min 0   max 0" in footer and "NaN" not in footer
        assert is_white(pixel(img, figures[0].axes[0], 0.5, 0.5))
    else:
        assert "min -20   max 27" in footer and "grey: 1 NaN/inf cell" in footer
        assert tuple(pixel(img, figures[0].axes[0], 3.5 / 8, 2.5 / 6)) == (160, 160, 160)


def test_names_are_not_mathtext(tmp_path, figures):
    z = zarr.create_array(str(tmp_path / "d.zarr"), shape=(2, 3), chunks=(2, 3), dtype="float32",
                          attributes={"kind": "jacobian", "of": "y$\\frac$", "wrt": "x_$^^$"})
    z[...] = 1.0
    decode(render_preview(z, kind=None, panels=4, size=512)[0])
    assert "Jacobian ∂y$\\frac$/∂x_$^^$" in [t.get_text() for t in figures[0].texts]


def test_colour_limit():
    assert colour_limit(np.array([[-3.0, 2.0, np.nan, np.inf]])) == 3.0
    assert colour_limit(np.zeros((2, 2))) == 1.0 and colour_limit(np.full((2, 2), np.nan)) == 1.0


def test_an_empty_result_is_a_placeholder(tmp_path):
    z = zarr.create_array(str(tmp_path / "e.zarr"), shape=(0, 3), chunks=(1, 3), dtype="float32")
    png, headers = render_preview(z, kind="jacobian", panels=4, size=512)
    assert headers == {} and decode(png).shape[1] >= 300


def test_a_preview_renders_in_well_under_a_second(tmp_path):
    z = zarr.create_array(str(tmp_path / "t.zarr"), shape=(4, 64, 4, 96), chunks=(1, 64, 4, 96), dtype="float32",
                          attributes={"kind": "jacobian", "of": "y", "wrt": "x"})
    z[...] = np.random.default_rng(3).normal(size=z.shape).astype(np.float32)
    render_preview(z, kind=None, panels=4, size=512)  # matplotlib imported, fonts cached
    best = min(_timed(lambda: render_preview(z, kind=None, panels=4, size=512)) for _ in range(3))
    assert best < 1.0, f"{best:.2f} s"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_the_api_imports_matplotlib_only_when_it_draws():
    code = "import sys, app.main; assert 'matplotlib' not in sys.modules and 'PIL' not in sys.modules, app.main"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
