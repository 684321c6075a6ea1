"""``jacobian compute --sparsity``: the option's spelling on the command line (``auto``, ``pattern_from:JOB``, a
``.npz`` of rows and cols). The sparse route itself runs in ``jacobian.cli_compute`` like every kind; when it does
not pay (or fails verification) the reason is printed and the dense result follows, as in the service."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sparsity", metavar="auto|pattern_from:JOB|FILE.npz",
                   help="kind jacobian or hessian: compute the matrix as a sparse matrix (COO) from a colouring of "
                        "its pattern (a Hessian: star colouring, one HVP per colour): 'auto' detects the pattern "
                        "from the graph; 'pattern_from:JOB' takes the entries of an earlier result under --out; a "
                        "path or URL of an .npz (rows, cols) gives it")


def parse_sparsity(text: str | None) -> Any:
    """The ``sparsity`` option from the command line's text."""
    if text is None:
        return None
    if text == "auto":
        return "auto"
    if text.startswith("pattern_from:"):
        return {"pattern_from": text.split(":", 1)[1]}
    return {"pattern_uri": text}
