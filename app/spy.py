"""preview.png of a sparse Jacobian: its sparsity pattern (a spy plot). The stored entries are counted on a
grid of at most ``size`` cells per side (``SparseResult.pattern_counts``: ``numpy.histogram2d`` of ``rows``
and ``cols``, read a slice at a time), each cell coloured by the share of its matrix entries that are
stored, white where none is; the title gives nnz, the density and the colours of the computation.
Drawn by matplotlib's Agg renderer (``app.plots``), laid out as the dense heatmaps (``app.heatmap``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from app import plots
from app.heatmap import LABEL, MatrixAxis, label_grid, panel_grid, set_ticks
from app.sparse import SparseResult

CMAP = "Blues"        # from its 30 % (a cell with few stored entries still shows) to dark: the densest cells


def _label(name: Any) -> str:
    text = str(name or "?")
    return text if len(text) <= 24 else "..." + text[-21:]


def pattern_notes(sp: SparseResult) -> list[str]:
    """``["nnz 1234", "density 0.31 %", "12 colours", ...]``: what the group's ``sparsity`` attribute says."""
    info = sp.attrs.get("sparsity") if isinstance(sp.attrs.get("sparsity"), dict) else {}
    notes = [f"nnz {sp.nnz}", f"density {100 * sp.density:.3g} %"]
    if isinstance(info.get("colors"), int):
        notes.append(f"{info['colors']} colours" + (f" ({info['mode']})" if info.get("mode") else ""))
    if info.get("source"):
        notes.append(f"pattern: {info['source']}")
    if "verified" in info:
        notes.append("verified" if info["verified"] else "not verified")
    return notes


def share_colours() -> Any:
    """``CMAP`` from 30 % of its range on, so that the lightest colour of a cell with a stored entry stands
    out from the white of the empty ones."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    return ListedColormap(colormaps[CMAP](np.linspace(0.3, 1.0, 256)), name="share")


def share_norm(share: np.ma.MaskedArray) -> tuple[Any, str]:
    """The colour scale of the cells' shares and a note for its label: logarithmic from the smallest to the
    largest share when they span more than a decade, else linear from 0 to the largest."""
    from matplotlib.colors import LogNorm, Normalize

    stored = share.compressed()
    low, high = (float(stored.min()), float(stored.max())) if stored.size else (1.0, 1.0)
    if high > 10 * low:
        return LogNorm(vmin=low, vmax=high), " (log)"
    return Normalize(vmin=0.0, vmax=high), ""


def render_pattern(sp: SparseResult, *, size: int, job_id: str | None = None) -> tuple[bytes, dict[str, str]]:
    """PNG bytes of the sparsity pattern of ``sp`` on at most ``size`` x ``size`` cells, and headers
    describing it (as ``render_preview``'s)."""
    n_of, n_wrt = sp.shape
    if n_of == 0 or n_wrt == 0:
        return plots.placeholder(f"Empty result, shape {sp.shape}: nothing to draw"), {}
    height, width = min(n_of, size), min(n_wrt, size)
    counts, cells = sp.pattern_counts(height, width)
    share = np.ma.masked_equal(counts / np.maximum(cells, 1), 0.0)
    of, wrt = _label(sp.attrs.get("of")), _label(sp.attrs.get("wrt"))
    title = f"Sparsity pattern of ∂{of}/∂{wrt}: nnz {sp.nnz}, density {100 * sp.density:.3g} %"
    notes = ([f"job {job_id}"] if job_id else []) + [f"{n_of} × {n_wrt}"] + pattern_notes(sp)[2:]
    cell_note = "" if (height, width) == (n_of, n_wrt) else \
        f"cells of {-(-n_of // height)} × {-(-n_wrt // width)} entries; "
    footer = f"{cell_note}white: no stored entry; colour: share of the cell's entries stored"
    grid = panel_grid(1, n_of, n_wrt, titled=False)
    natural_w, fig_h = grid.size
    fig = plots.new_figure(natural_w, fig_h, title=title, subtitle=",  ".join(notes), footer=footer)
    shift = (fig.get_figwidth() - natural_w) / 2
    x, y = grid.panel(0)
    ax = plots.add_axes_in(fig, shift + x, y, grid.panel_w, grid.panel_h)
    norm, scale = share_norm(share)
    image = ax.imshow(share, cmap=share_colours(), norm=norm, aspect="auto", interpolation="nearest",
                      extent=(-0.5, n_wrt - 0.5, n_of - 0.5, -0.5))
    row_axis, col_axis = MatrixAxis(of, sp.of_shape), MatrixAxis(wrt, sp.wrt_shape)
    set_ticks(ax.xaxis, col_axis.shape)
    set_ticks(ax.yaxis, row_axis.shape)
    ax.tick_params(labelsize=plots.SMALL_PT, length=3, pad=2)
    bar, grid_h = label_grid(fig, image, grid, shift=shift, natural_w=natural_w, fig_h=fig_h, row_axis=row_axis,
                             col_axis=col_axis)
    if grid_h > 1.6:
        bar.set_label(f"share of the cell stored{scale}", **LABEL)
    headers = {"X-Preview-Matrix": f"{n_of}x{n_wrt}", "X-Preview-Cells": f"{height}x{width}",
               "X-Preview-Panels": "1/1", "X-Preview-Nnz": str(sp.nnz)}
    return plots.figure_to_png(fig), headers
