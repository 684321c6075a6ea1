"""preview.png of the matrix-free spectra: singular values (``svd``, log scale) or eigenvalues
(``hessian_eig``, with the zero line) by index, each marked with its relative residual; a diagonal
(``hessian_diag``) by flat index (the range of each block of entries when there are thousands); the smoothed
density of ``spectral_density`` over its grid (preview ``density``); a 0-d estimate (``hessian_trace``,
``logdet``) with its standard error. The words are the kind's (``contracts.kinds.Spectrum``).
Drawn by matplotlib's Agg renderer (``app.plots``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from app.plots import INK, MUTED, add_axes_in, figure_to_png, new_figure
from contracts.kinds import Spectrum, kind_spec

MARKED = 200     # values drawn with a marker each; more: a line
BANDS = 2048     # values drawn one by one; more: the range of each of this many blocks


def render_spectrum(values: np.ndarray, attrs: dict[str, Any], *, job_id: str | None = None,
                    stderr: float | None = None, kind: str | None = None) -> bytes:
    """PNG bytes for a spectral result: ``values`` (the kind's main array: ``S``, ``eigenvalues``, ``diagonal``,
    ``density``, or a 0-d ``trace`` or ``logdet``), ``attrs``
    the group's (kind, of, wrt, method, residuals, products); ``kind`` (default: the attribute) a spectral one."""
    spec = kind_spec(kind or str(attrs.get("kind")))
    words: Spectrum | None = spec.spectrum
    if words is None:
        raise ValueError(f"kind {spec.name!r} has no spectrum to draw")
    of, wrt = str(attrs.get("of") or "?"), attrs.get("wrt") or "?"
    wrt = ", ".join(wrt) if isinstance(wrt, list) else str(wrt)
    products = attrs.get("products") or {}
    spent = ", ".join(f"{n} {c}" for n, c in products.items() if c)
    damping = f"damping {float(attrs['damping']):g}" if attrs.get("damping") is not None else ""
    subtitle = ",  ".join(x for x in (f"job {job_id}" if job_id else "", f"{attrs.get('method', '')}", damping,
                                      f"products: {spent}" if spent else "") if x)
    title = words.title.format(of=of, wrt=wrt)
    if not spec.dims[0]:   # one number (the trace) and its standard error
        fig = new_figure(6.0, 2.2, title=title, subtitle=subtitle)
        text = f"{words.value} ≈ {float(values):.6g}" + (f"  ± {stderr:.3g} (standard error)" if stderr
                                                           else "  (exact)")
        fig.text(0.5, 0.4, text, ha="center", va="center", fontsize=15, color=INK, parse_math=False)
        return figure_to_png(fig)
    values = np.asarray(values, np.float64).ravel()
    if spec.preview == "density":
        return _density(values, attrs, title, subtitle, words)
    residuals = np.asarray(attrs.get("residuals") or [np.nan] * len(values), np.float64)
    footer = words.residual
    if residuals.size and np.isfinite(residuals).any():
        footer += f": largest {np.nanmax(residuals):.2g}"
    if attrs.get("method") == "hutchinson" and attrs.get("probes"):   # a diagonal's estimate
        footer = f"{attrs['probes']} Rademacher probes; each entry's standard error is in the array stderr"
    many = len(values) > MARKED
    if len(values) > BANDS:
        footer = f"the range of each block of {-(-len(values) // BANDS)} entries"
    fig = new_figure(6.4, 3.8, title=title, subtitle=subtitle, footer=footer)
    ax = add_axes_in(fig, 1.15, 0.8, fig.get_figwidth() - 1.55, 2.2)
    k = np.arange(1, len(values) + 1)
    if len(values) > BANDS:   # a large diagonal: the smallest and largest entry of each block
        per = -(-len(values) // BANDS)
        bands = -(-len(values) // per)
        blocks = np.pad(values, (0, per * bands - len(values)), constant_values=np.nan).reshape(bands, per)
        ax.fill_between(np.arange(bands) * per + 1, np.nanmin(blocks, axis=1), np.nanmax(blocks, axis=1),
                        color="#b2182b", linewidth=0.6, step="post")
    else:
        ax.plot(k, values, "-" if many else "o-", color="#b2182b", markersize=5, linewidth=1.0 if many else 1.2)
    if words.log_scale and (values > 0).all() and values.max() > 10 * values.min():  # a log axis when they span decades
        ax.set_yscale("log")
    else:
        ax.axhline(0.0, color=MUTED, linewidth=0.8)
    ax.set_xlabel(words.order, color=INK)
    ax.set_ylabel(words.value, color=INK)
    ax.set_xticks(k if len(k) <= 20 else np.linspace(1, len(k), 10).round().astype(int))
    ax.grid(True, color="#dddddd", linewidth=0.6)
    return figure_to_png(fig)


def _density(values: np.ndarray, attrs: dict[str, Any], title: str, subtitle: str, words: Spectrum) -> bytes:
    """A density curve over the even grid of ``attrs["grid_range"]``, its smoothing and probes in the footer."""
    low, high = (attrs.get("grid_range") or [0.0, 1.0])[:2]
    grid = np.linspace(float(low), float(high), len(values))
    sigma, probes, steps = attrs.get("sigma"), attrs.get("probes"), attrs.get("steps")
    footer = ", ".join(x for x in (f"Gaussian smoothing σ = {float(sigma):.3g}" if sigma is not None else "",
                                   f"{probes} probes × {steps} Lanczos steps" if probes else "",
                                   f"{attrs.get('start_vectors')} start vectors" if attrs.get("start_vectors") else "")
                       if x)
    fig = new_figure(6.4, 3.8, title=title, subtitle=subtitle, footer=footer)
    ax = add_axes_in(fig, 1.15, 0.8, fig.get_figwidth() - 1.55, 2.2)
    ax.fill_between(grid, values, color="#f4a582", linewidth=0)
    ax.plot(grid, values, "-", color="#b2182b", linewidth=1.2)
    ax.set_xlabel(words.order, color=INK)
    ax.set_ylabel(words.value, color=INK)
    ax.grid(True, color="#dddddd", linewidth=0.6)
    return figure_to_png(fig)
