"""What a matrix-free kind produced (``worker.engine.matfree``, ``spectra``, ``solve``): arrays, how, and JSON
attributes for the result group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class MatFreeResult:
    """What a matrix-free kind produced: ``arrays`` by storage name (``products``; ``S``, ``U``, ``V``;
    ``eigenvalues``, ``eigenvectors``; ``trace``, ``stderr``) and how: ``method``, ``iterations``,
    ``residuals`` (or None), ``products`` (counts by kind, and ``checks``), ``converged``, and ``attrs``
    (JSON: tolerances, sizes, what the residuals measure)."""

    kind: str
    method: str
    arrays: dict[str, np.ndarray]
    products: dict[str, int]
    iterations: int = 0
    residuals: np.ndarray | None = None
    converged: bool = True
    attrs: dict[str, Any] = field(default_factory=dict)

    def attributes(self) -> dict[str, Any]:
        """JSON attributes for the result group."""
        out = {"kind": self.kind, "method": self.method, "iterations": self.iterations, "products": self.products,
               "converged": self.converged, **self.attrs}
        if self.residuals is not None:
            out["residuals"] = [float(r) for r in np.asarray(self.residuals, np.float64)]
        return out
