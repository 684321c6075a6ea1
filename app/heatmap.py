"""Heatmaps of a Zarr array seen as a matrix: block-averaged downsampling read one storage chunk at a
time, drawn by matplotlib (``app.plots``) with a diverging colour map centred on zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from app import plots

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# -- downsampling ------------------------------------------------------------------------------------


@dataclass
class Downsampled:
    """Block means ``panels`` ``(P, H, W)`` of a ``rows x cols`` matrix view, and raw min/max."""

    panels: np.ndarray
    rows: int
    cols: int
    raw_min: float = math.inf
    raw_max: float = -math.inf
    panels_total: int = 1


def _bins(n: int, size: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * size) // max(1, n)


def _ravel(shape: Sequence[int], sels: Sequence[slice]) -> np.ndarray:
    """Flat C-order indices within ``shape`` of the rectangle ``sels`` (increasing)."""
    flat = np.zeros(1, dtype=np.int64)
    for dim, sel in zip(shape, sels):
        flat = (flat[:, None] * dim + np.arange(sel.start, sel.stop, dtype=np.int64)[None, :]).ravel()
    return flat


def _runs(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions of the runs of a non-decreasing array, and the value of each run."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(bins)) + 1]).astype(np.intp)
    return starts, bins[starts]


def block_mean(array: Any, *, row_axes: int, batch: bool = False, max_panels: int = 4,
               max_side: int = 512) -> Downsampled:
    """Block means of ``array`` seen as a matrix (the first ``row_axes`` axes flattened into rows, the
    rest into columns; with ``batch``, axis 0 gives one panel per example, at most ``max_panels``),
    downsampled to at most ``max_side`` per side. Reads the array one storage chunk at a time (its
    ``shards``, else its ``chunks``), so memory stays at one chunk plus the ``(P, H, W)`` sums."""
    shape = tuple(int(d) for d in array.shape)
    lead = 1 if batch else 0
    if batch and not shape:
        raise ValueError("batch needs a leading batch axis")
    n_panels = min(shape[0], max_panels) if batch else 1
    row_shape, col_shape = shape[lead:lead + row_axes], shape[lead + row_axes:]
    rows, cols = math.prod(row_shape), math.prod(col_shape)
    height, width = min(rows, max_side), min(cols, max_side)
    sums = np.zeros((n_panels, height, width), dtype=np.float64)
    out = Downsampled(sums, rows, cols, panels_total=shape[0] if batch else 1)
    if rows == 0 or cols == 0 or n_panels == 0:
        out.panels = np.full((max(1, n_panels), max(1, height), max(1, width)), np.nan)
        return out
    row_bins, col_bins = _bins(rows, height), _bins(cols, width)
    counts = np.outer(np.bincount(row_bins, minlength=height), np.bincount(col_bins, minlength=width))
    chunks = tuple(getattr(array, "shards", None) or array.chunks) if shape else ()
    limits = list(shape)
    if batch:
        limits[0] = n_panels
    grid = [range(0, lim, max(1, c)) for lim, c in zip(limits, chunks)]
    for corner in np.ndindex(*[len(g) for g in grid]):
        sel = tuple(slice(g[i], min(g[i] + c, lim)) for g, i, c, lim in zip(grid, corner, chunks, limits))
        data = np.asarray(array[sel] if sel else array[...])
        b = sel[0].stop - sel[0].start if batch else 1
        row_sel, col_sel = sel[lead:lead + row_axes], sel[lead + row_axes:]
        r = _ravel(row_shape, row_sel)
        c = _ravel(col_shape, col_sel)
        block = data.reshape(b, r.size, c.size)
        finite = block[np.isfinite(block)]
        if finite.size:
            out.raw_min = min(out.raw_min, float(finite.min()))
            out.raw_max = max(out.raw_max, float(finite.max()))
        c_starts, c_bins = _runs(col_bins[c])
        r_starts, r_bins = _runs(row_bins[r])
        part = np.add.reduceat(block, c_starts, axis=2, dtype=np.float64)
        part = np.add.reduceat(part, r_starts, axis=1)
        p0 = sel[0].start if batch else 0
        sums[np.ix_(np.arange(p0, p0 + b), r_bins, c_bins)] += part
    out.panels = sums / counts[None, :, :]
    return out


# -- the picture -------------------------------------------------------------------------------------

CMAP = "RdBu_r"           # blue negative, white zero, red positive
NAN_COLOUR = "#a0a0a0"    # cells whose block mean is NaN or infinite
MAX_COLUMNS = 4           # panels side by side before a new row starts


@dataclass(frozen=True)
class MatrixAxis:
    """One side of the matrix: the tensor ``name``, whose axes of ``shape`` are flattened onto it."""

    name: str
    shape: tuple[int, ...]

    def label(self, role: str) -> str:
        """``"rows: y, shape (3, 16), flattened to 48"``."""
        if not self.shape:
            return f"{role}: {self.name} (a scalar)"
        flat = f", flattened to {math.prod(self.shape)}" if len(self.shape) > 1 else ""
        return f"{role}: {self.name}, shape {self.shape}{flat}"


def colour_limit(panels: np.ndarray) -> float:
    """The colour scale's half-width: the largest absolute finite cell (1.0 when there is none or it is 0)."""
    finite = panels[np.isfinite(panels)]
    limit = float(np.abs(finite).max()) if finite.size else 0.0
    return limit if limit > 0 else 1.0


def set_ticks(axis: Any, shape: tuple[int, ...]) -> None:
    """Labelled ticks at the first element of each entry of the leading axis when it has a few
    (``(3, 16)``: 0, 16, 32; with a minor tick per element up to 32), else at a few round indices."""
    from matplotlib.ticker import FixedLocator, MaxNLocator, MultipleLocator

    n = math.prod(shape)
    if len(shape) >= 2 and 2 <= shape[0] <= 10 and n > shape[0]:
        axis.set_major_locator(FixedLocator(np.arange(0, n, n // shape[0])))
        if n <= 32:
            axis.set_minor_locator(MultipleLocator(1))
    else:
        axis.set_major_locator(MaxNLocator(nbins=6, integer=True, min_n_ticks=1))


def _footer(ds: Downsampled, limit: float) -> str:
    parts = [f"min {ds.raw_min:.4g}   max {ds.raw_max:.4g}" if math.isfinite(ds.raw_min) else "no finite values"]
    parts.append(f"colours from -{limit:.3g} to +{limit:.3g}, white at zero")
    bad = int(np.count_nonzero(~np.isfinite(ds.panels)))
    if bad:
        parts.append(f"grey: {bad} NaN/inf cell{'s' if bad > 1 else ''}")
    return "   ·   ".join(parts)


@dataclass(frozen=True)
class PanelGrid:
    """Where the panels go, in inches: ``ncols`` x ``nrows`` panels of ``panel_w`` x ``panel_h``."""

    ncols: int
    nrows: int
    panel_w: float
    panel_h: float
    left: float       # row label and y tick labels
    gap_x: float
    gap_y: float      # x tick labels (above a missing panel) and the next panel's title
    top: float        # header and the first panel's title
    bottom: float = plots.FOOTER_IN + 0.6   # x tick labels, column label, footer
    right: float = 1.35               # colour bar, its tick labels and its label

    @property
    def size(self) -> tuple[float, float]:
        return (self.left + self.ncols * self.panel_w + (self.ncols - 1) * self.gap_x + self.right,
                self.top + self.nrows * self.panel_h + (self.nrows - 1) * self.gap_y + self.bottom)

    def panel(self, p: int) -> tuple[float, float]:
        """Bottom-left corner of panel ``p`` (row-major from the top left)."""
        row, col = divmod(p, self.ncols)
        return (self.left + col * (self.panel_w + self.gap_x),
                self.bottom + (self.nrows - 1 - row) * (self.panel_h + self.gap_y))


def panel_grid(n: int, rows: int, cols: int, *, titled: bool) -> PanelGrid:
    """Panels about 5 inches wide alone, 3.6 two abreast, 2.7 from three; height by the matrix's
    aspect ratio clamped to 1:4..4:1, at most 5 (alone) or 3 inches."""
    ncols = min(n, MAX_COLUMNS)
    aspect = min(4.0, max(0.25, rows / cols))
    panel_w = min({1: 5.0, 2: 3.6}.get(ncols, 2.7), (5.0 if n == 1 else 3.0) / aspect)
    tick_w = 0.08 * len(str(rows)) + 0.12
    title_h = 0.3 if titled else 0.0
    return PanelGrid(ncols, -(-n // ncols), panel_w, panel_w * aspect, left=plots.PAD_IN + 0.3 + tick_w,
                 gap_x=0.2, gap_y=0.35 + title_h, top=plots.HEADER_IN + title_h)


def render_heatmap(ds: Downsampled, *, title: str, subtitle: str = "", row_axis: MatrixAxis,
                   col_axis: MatrixAxis, panel_titles: Sequence[str] | None = None,
                   value_label: str = "") -> bytes:
    """PNG bytes of ``heatmap_figure``."""
    return plots.figure_to_png(heatmap_figure(ds, title=title, subtitle=subtitle, row_axis=row_axis,
                                              col_axis=col_axis, panel_titles=panel_titles,
                                              value_label=value_label))


def heatmap_figure(ds: Downsampled, *, title: str, subtitle: str = "", row_axis: MatrixAxis,
                   col_axis: MatrixAxis, panel_titles: Sequence[str] | None = None,
                   value_label: str = "") -> Figure:
    """The panels ``ds.panels`` ``(P, H, W)`` as heatmaps in a grid of up to ``MAX_COLUMNS`` columns,
    rows down and columns across with ticks at element indices of the full matrix, one shared diverging
    colour scale symmetric about zero at the largest absolute cell, a colour bar, a title line, a
    subtitle line and a footer with the raw minimum and maximum; the figure's axes are the panels in
    order, then the colour bar."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    n, height, width = ds.panels.shape
    rows, cols = max(1, ds.rows), max(1, ds.cols)
    limit = colour_limit(ds.panels)
    grid = panel_grid(n, rows, cols, titled=bool(panel_titles))
    natural_w, fig_h = grid.size
    fig = plots.new_figure(natural_w, fig_h, title=title, subtitle=subtitle, footer=_footer(ds, limit))
    shift = (fig.get_figwidth() - natural_w) / 2     # centre the panels when the texts widened the figure

    cmap = colormaps[CMAP].with_extremes(bad=NAN_COLOUR)
    norm = Normalize(vmin=-limit, vmax=limit)
    extent = (-0.5, cols - 0.5, rows - 0.5, -0.5)  # element indices of the full matrix at cell centres
    whole_pixels = width <= grid.panel_w * plots.DPI and height <= grid.panel_h * plots.DPI
    for p in range(n):
        x, y = grid.panel(p)
        ax = plots.add_axes_in(fig, shift + x, y, grid.panel_w, grid.panel_h)
        image = ax.imshow(np.ma.masked_invalid(ds.panels[p]), cmap=cmap, norm=norm, aspect="auto", extent=extent,
                          interpolation="nearest" if whole_pixels else "auto")
        set_ticks(ax.xaxis, col_axis.shape)
        set_ticks(ax.yaxis, row_axis.shape)
        ax.tick_params(labelsize=plots.SMALL_PT, length=3, pad=2, labelleft=p % grid.ncols == 0,
                       labelbottom=p + grid.ncols >= n)  # tick labels on the outer panels only
        ax.tick_params(which="minor", length=1.5)
        if panel_titles:
            ax.set_title(panel_titles[p], fontsize=plots.TEXT_PT, pad=4, parse_math=False)

    bar, grid_h = label_grid(fig, image, grid, shift=shift, natural_w=natural_w, fig_h=fig_h, row_axis=row_axis,
                             col_axis=col_axis)
    if value_label and len(value_label) * 0.085 < grid_h:  # along the bar; the title says it anyway
        bar.set_label(value_label, **LABEL)
    return fig


LABEL = {"fontsize": plots.TEXT_PT, "color": plots.INK, "parse_math": False}   # the axes' and the bar's labels


def label_grid(fig: Any, image: Any, grid: Any, *, shift: float, natural_w: float, fig_h: float, row_axis: Any,
               col_axis: Any) -> tuple[Any, float]:
    """The row and column labels beside a panel grid and the colour bar right of it (the heatmap's and the
    sparsity pattern's); returns the bar and the grid's height in inches."""
    grid_w, grid_h = natural_w - grid.left - grid.right, fig_h - grid.top - grid.bottom
    plots.text_in(fig, shift + plots.PAD_IN, grid.bottom + grid_h / 2, row_axis.label("rows"), rotation=90,
                  ha="left", va="center", **LABEL)
    plots.text_in(fig, shift + grid.left + grid_w / 2, grid.bottom - 0.3, col_axis.label("columns"),
                  ha="center", va="top", **LABEL)
    bar = fig.colorbar(image, cax=plots.add_axes_in(fig, shift + grid.left + grid_w + 0.25, grid.bottom, 0.17, grid_h))
    bar.ax.tick_params(labelsize=plots.SMALL_PT, length=3, pad=2)
    return bar, grid_h
