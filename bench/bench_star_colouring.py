"""Star colouring time of sparse Hessian patterns (issue 27), in-process: ``colour_hessian`` (star colouring plus its
recovery check, the engine's path) on 10^5 variables, a tridiagonal pattern (``sum_i x_i^2 x_{i+1}``) without and
with a hub (one variable coupled to all others: a dense row and column) at the start, the middle or the end. Each
row: the best of ``--repeat`` wall times, the colours and the mode (``star``, or ``forward``: the distance-2
fallback; ``None``: more than ``--limit`` colours, the dense route).

``--impl FILE`` times another ``hessian.py`` (e.g. the one before the linear-time colouring), for before/after::

    python -m bench.bench_star_colouring --out bench/results
    git show 086da65:worker/engine/sparsity/hessian.py > /tmp/old_hessian.py
    python -m bench.bench_star_colouring --impl /tmp/old_hessian.py --repeat 1
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Any

import numpy as np


def tridiagonal(n: int, hub: int | None) -> Any:
    """The symmetric pattern of ``sum_i x_i^2 x_{i+1}`` (plus ``x_hub`` coupled to every variable)."""
    import scipy.sparse as sp

    from worker.engine.sparsity.hessian import symmetrized

    i = np.arange(n - 1)
    rows, cols = [np.arange(n), i], [np.arange(n), i + 1]
    if hub is not None:
        rows.append(np.full(n, hub))
        cols.append(np.arange(n))
    r, c = np.concatenate(rows), np.concatenate(cols)
    return symmetrized(sp.csr_array((np.ones(len(r), bool), (r, c)), shape=(n, n)))


def implementation(path: str | None) -> Any:
    if path is None:
        from worker.engine.sparsity import hessian

        return hessian
    spec = importlib.util.spec_from_file_location("hessian_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--limit", type=int, default=1000, help="colours beyond which the dense route is taken")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--impl", help="a hessian.py to time instead of the engine's")
    ap.add_argument("--out", help="write star_colouring.json here")
    args = ap.parse_args()
    module = implementation(args.impl)
    rows = []
    for label, hub in (("no hub", None), ("hub first", 0), ("hub in the middle", args.n // 2),
                       ("hub last", args.n - 1)):
        pattern = tridiagonal(args.n, hub)
        best, got = float("inf"), None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            got = module.colour_hessian(pattern, limit=args.limit)
            best = min(best, time.perf_counter() - t0)
        rows.append({"pattern": label, "n": args.n, "nnz": int(pattern.nnz), "seconds": round(best, 3),
                     "colours": None if got is None else got.count, "mode": None if got is None else got.mode,
                     "impl": args.impl or "engine"})
        print(rows[-1], flush=True)
    if args.out:
        from bench.common import emit

        emit("star_colouring", rows, args.out)


if __name__ == "__main__":
    main()
