"""preview.png of the matrix-free spectra: singular values (``svd``, log scale) or eigenvalues
(``hessian_eig``, with the zero line) by index, each marked with its relative residual, and the trace
estimate of ``hessian_trace`` with its standard error. Drawn by matplotlib's Agg renderer (``app.plots``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from app.plots import INK, MUTED, add_axes_in, figure_to_png, new_figure


def render_spectrum(values: np.ndarray, attrs: dict[str, Any], *, job_id: str | None = None,
                    stderr: float | None = None) -> bytes:
    """PNG bytes for a spectral result: ``values`` (``S``, ``eigenvalues`` or the 0-d ``trace``), ``attrs``
    the group's (kind, of, wrt, method, residuals, products)."""
    kind = str(attrs.get("kind"))
    of, wrt = str(attrs.get("of") or "?"), attrs.get("wrt") or "?"
    wrt = ", ".join(wrt) if isinstance(wrt, list) else str(wrt)
    products = attrs.get("products") or {}
    spent = ", ".join(f"{n} {c}" for n, c in products.items() if c)
    subtitle = ",  ".join(x for x in (f"job {job_id}" if job_id else "", f"{attrs.get('method', '')}",
                                      f"products: {spent}" if spent else "") if x)
    if kind == "hessian_trace":
        fig = new_figure(6.0, 2.2, title=f"Trace of the Hessian of {of} w.r.t. {wrt}", subtitle=subtitle)
        text = f"tr(H) ≈ {float(values):.6g}" + (f"  ± {stderr:.3g} (standard error)" if stderr else "  (exact)")
        fig.text(0.5, 0.4, text, ha="center", va="center", fontsize=15, color=INK, parse_math=False)
        return figure_to_png(fig)
    values = np.asarray(values, np.float64).ravel()
    residuals = np.asarray(attrs.get("residuals") or [np.nan] * len(values), np.float64)
    name = "singular value" if kind == "svd" else "eigenvalue"
    title = (f"Singular values of ∂{of}/∂{wrt}" if kind == "svd" else f"Eigenvalues of the Hessian of {of} "
             f"w.r.t. {wrt}")
    footer = "residual ||J v - s u|| / s" if kind == "svd" else "residual ||H v - λ v||"
    if residuals.size and np.isfinite(residuals).any():
        footer += f": largest {np.nanmax(residuals):.2g}"
    fig = new_figure(6.4, 3.8, title=title, subtitle=subtitle, footer=footer)
    ax = add_axes_in(fig, 1.15, 0.8, fig.get_figwidth() - 1.55, 2.2)
    k = np.arange(1, len(values) + 1)
    ax.plot(k, values, "o-", color="#b2182b", markersize=5, linewidth=1.2)
    if kind == "svd" and (values > 0).all() and values.max() > 10 * values.min():  # a log axis when they span decades
        ax.set_yscale("log")
    else:
        ax.axhline(0.0, color=MUTED, linewidth=0.8)
    ax.set_xlabel("k (largest first)" if kind == "svd" else "k (largest magnitude first)", color=INK)
    ax.set_ylabel(name, color=INK)
    ax.set_xticks(k if len(k) <= 20 else np.linspace(1, len(k), 10).round().astype(int))
    ax.grid(True, color="#dddddd", linewidth=0.6)
    return figure_to_png(fig)
