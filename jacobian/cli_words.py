"""The command line's spelling of the request rules' messages: a request field as its flag (``wrt: ...`` ->
``--wrt: ...``) and the API's words for a fix as the flags that make it (``reduce='sum'`` -> ``--reduce sum``).
``jacobian compute`` and ``jacobian submit`` print every refusal and failure through ``as_flag``."""

from __future__ import annotations

from typing import Any

FLAGS = ("wrt", "of", "rank", "tol", "samples", "sparsity", "reduce", "output_dtype", "kind", "mode", "seeds",
         "memory_budget_bytes", "chunk_rows", "inputs", "max_iterations", "allow_unconverged", "loss", "labels",
         "damping", "curvature", "probes", "steps", "sigma", "precondition")
# the API's words for a fix inside a message, in the command line's
SPELLINGS = (("reduce='sum'", "--reduce sum"),
             ("(listed by GET /v1/models/signature)", "(--wrt variables/<name> with a name the model does not "
              "have lists them all)"),
             ("GET /v1/models/signature", "the model's signature"),
             ("allow_unconverged: true", "--allow-unconverged"), ("max_iterations (", "--max-iterations ("),
             ("loosen tol (", "loosen --tol ("), ("smaller rank (", "smaller --rank ("),
             ("set memory_budget_bytes to at least", "pass --memory-budget of at least"),
             ("use mode 'auto' or 'reverse'", "use --mode auto or --mode reverse"),
             ("a smaller of or wrt", "a smaller --of or --wrt"))


def as_flag(message: str) -> str:
    """A message that starts with a request field (``wrt: ...``) in the command line's spelling (``--wrt: ...``),
    and the API's words for a fix as flags (``SPELLINGS``: ``reduce='sum'`` as ``--reduce sum``)."""
    head, sep, rest = message.partition(":")
    name = head.split(".")[0]
    if sep and name in FLAGS:
        flag = {"memory_budget_bytes": "memory-budget", "inputs": "input"}.get(name, name.replace("_", "-"))
        message = f"--{flag}{head[len(name):]}:{rest}"
    for api, cli in SPELLINGS:
        message = message.replace(api, cli)
    return message


def cli_spelling(err: Any) -> str:
    """A request refused by the rules (a ``pydantic.ValidationError``) in the command line's words."""
    parts = []
    for e in err.errors():
        message = str(e.get("msg", "")).removeprefix("Value error, ")
        field = ".".join(str(p) for p in e.get("loc", ()) if not isinstance(p, int))
        parts.append(as_flag(message if ":" in message.split(" ")[0] or not field else f"{field}: {message}"))
    return "; ".join(parts)


def precision_words(result: dict[str, Any]) -> str:
    """The precision guard's fields of a manifest or a job's result as the tail of a ``done:``/``succeeded:`` line
    (``; precision error ~3.1e-07 (3 float64 probes)``, promoted or not); "" when it has none."""
    error, method = result.get("precision_error"), result.get("precision_method")
    if error is None:
        return f"; precision: {method}" if method else ""
    words = f"; precision error ~{float(error):.2g} ({result.get('precision_probes', 0)} float64 probes)"
    if result.get("precision_promoted"):
        words += f", promoted to float64 (estimate was {float(result.get('precision_error_before') or 0):.2g} > tol " \
                 f"{float(result.get('precision_tol') or 0):.2g})"
    return words
