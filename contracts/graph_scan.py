"""The graph scan: ops of a SavedModel outside the allowlist (``op_allowlist.txt``), found before any load.

A SavedModel is a program: its functions may read and write files, call Python or reach the network.
``refused_ops`` walks every node of the top-level graph and of every function in the library and
returns the ``(op, node, function)`` of each op that is neither on the allowlist, nor a function of
the library, nor in the operator's extra ops for the model's root (``Settings.model_op_allow``). The
``saver`` family (``SaveV2``, ``RestoreV2``, ...) is allowed only in the functions that the
``saver_def``'s save and restore nodes call and nothing else calls. No TensorFlow is imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from contracts.graph_ops import TOP_LEVEL, GraphOps, parse_graph_ops
from contracts.savedmodel import SAVED_MODEL_FILE, SavedModelError
from contracts.storage import is_remote, is_under

ALLOWLIST_FILE = Path(__file__).with_name("op_allowlist.txt")
SAVER_FAMILY = "saver"
ALLOW_SETTING = "JACOBIAN_MODEL_OP_ALLOW"

# Why some refused ops are refused, for the message (anything else: not on the allowlist).
_FILE_OPS = frozenset({"ReadFile", "WriteFile", "MatchingFiles", "DeleteFile", "FileExists", "IsDirectory",
                       "CreateDir", "RecursivelyCreateDir", "RenameFile", "CopyFile", "DeleteRecursively",
                       "ImmutableConst", "DebugIdentityV3", "WriteSummary", "CreateSummaryFileWriter",
                       "SummaryWriter", "WriteScalarSummary", "WriteRawProtoSummary", "DecodeProtoV2"})
_PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


class Refusal(NamedTuple):
    """One refused node: its ``op``, its ``node`` name and the ``function`` it sits in (``""``: top level)."""

    op: str
    node: str
    function: str

    def where(self) -> str:
        """``node 'x' in function 'f'`` (or ``in the top-level graph``)."""
        place = f"function {self.function!r}" if self.function != TOP_LEVEL else "the top-level graph"
        return f"node {self.node!r} in {place}"


@dataclass(frozen=True)
class Allowlist:
    """The allowed ops by family (``op_allowlist.txt``: ``## family: description`` headers, one op a line)."""

    families: Mapping[str, frozenset[str]]

    @property
    def anywhere(self) -> frozenset[str]:
        """Ops allowed in any function: every family but ``saver``."""
        return frozenset().union(*(ops for name, ops in self.families.items() if name != SAVER_FAMILY))

    @property
    def saver(self) -> frozenset[str]:
        """Checkpoint ops, allowed only in the saver's own functions."""
        return self.families.get(SAVER_FAMILY, frozenset())

    @property
    def every_op(self) -> frozenset[str]:
        return self.anywhere | self.saver


class ModelRefused(ValueError):
    """The model's graph holds ops outside the allowlist; ``refusals`` lists each ``(op, node, function)``."""

    def __init__(self, refusals: list[Refusal], *, field: str, root: str | None = None) -> None:
        self.refusals = refusals
        self.field = field
        self.root = root
        super().__init__(self.message)

    @property
    def message(self) -> str:
        first = self.refusals[0]
        ops = sorted({r.op for r in self.refusals})
        more = len(self.refusals) - 1
        others = f"; {more} more refused node{'s' if more > 1 else ''} (ops: {', '.join(ops)})" if more else ""
        allow = json.dumps({self.root or "<model root>": ops})
        return (f"{self.field}: the model uses op {first.op!r} ({first.where()}), which {_why(first.op)}{others}; "
                f"the service runs only pure math, array, control-flow and variable ops: export the model "
                f"without it, or ask the operator to allow it for this model root with "
                f"{ALLOW_SETTING}='{allow}'")

    def __str__(self) -> str:
        return self.message


def _why(op: str) -> str:
    if op in _FILE_OPS:
        return "reads or writes files"
    if op in _PYTHON_OPS:
        return "runs Python code"
    if op in allowlist().saver:
        return "reads or writes checkpoint files outside the saver's own functions"
    return f"is not on the allowlist (contracts/{ALLOWLIST_FILE.name})"


def parse_allowlist(text: str) -> Allowlist:
    """``## family: description`` starts a family, ``#`` a comment; every other non-blank line is one op name."""
    families: dict[str, set[str]] = {}
    family: set[str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("##"):
            name = line[2:].split(":", 1)[0].strip()
            if not name.isidentifier():
                raise ValueError(f"{ALLOWLIST_FILE.name}:{number}: {line!r} must be '## family: description'")
            family = families.setdefault(name, set())
            continue
        line = line.split("#", 1)[0].strip()
        if line:
            if family is None or not line.isidentifier():
                raise ValueError(f"{ALLOWLIST_FILE.name}:{number}: {line!r} must be one op name under a "
                                 "'## family' header")
            family.add(line)
    return Allowlist({name: frozenset(ops) for name, ops in families.items()})


@lru_cache(maxsize=1)
def allowlist() -> Allowlist:
    """The allowlist shipped in ``contracts/op_allowlist.txt``."""
    return parse_allowlist(ALLOWLIST_FILE.read_text())


def saver_functions(graph: GraphOps) -> set[str]:
    """The library functions only the ``saver_def``'s save and restore nodes reach (where checkpoint ops belong)."""
    top = graph.functions.get(TOP_LEVEL, ())
    saver_calls = [c for n in top if n.name in graph.saver_nodes for c in (*n.calls, n.op)]
    saver = graph.reachable(saver_calls)
    others = [c for n in top if n.name not in graph.saver_nodes for c in (*n.calls, n.op)]
    others += [name for name in graph.functions if name != TOP_LEVEL and name not in saver]
    return saver - graph.reachable(others)


def refused_ops(graph: GraphOps, *, allowed: Allowlist | None = None,
                extra: frozenset[str] = frozenset()) -> list[Refusal]:
    """Every ``(op, node, function)`` whose op is not allowed where it sits, in the graph's order."""
    allowed = allowed or allowlist()
    anywhere = allowed.anywhere | extra | (graph.functions.keys() - {TOP_LEVEL})
    in_saver = anywhere | allowed.saver
    saver = saver_functions(graph)
    return [Refusal(node.op, node.name, name) for name, nodes in graph.functions.items()
            for node in nodes if node.op not in (in_saver if name in saver else anywhere)]


def extra_ops(model_dir: str | os.PathLike[str],
              op_allow: Mapping[str, list[str]]) -> tuple[frozenset[str], str | None]:
    """The ops ``op_allow`` (``Settings.model_op_allow``: folder or ``s3://`` prefix -> op names) allows for
    ``model_dir`` (a path or an ``s3://`` URL): those of every folder it lies in (``storage.is_under``); and the
    innermost such folder, or None."""
    ops: set[str] = set()
    innermost: str | None = None
    for folder, names in op_allow.items():
        if is_under(model_dir, folder):
            ops.update(names)
            innermost = folder if innermost is None or is_under(folder, innermost) else innermost
    return frozenset(ops), None if innermost is None else _shown(innermost)


def _shown(folder: str) -> str:
    """A folder as messages show it: a local one resolved, a URL without its trailing ``/``."""
    return folder.rstrip("/") if is_remote(folder) else str(Path(folder).expanduser().resolve())


@lru_cache(maxsize=64)
def _graph_cached(path: str, mtime_ns: int, size: int) -> GraphOps:
    with open(path, "rb") as f:
        return parse_graph_ops(f.read())


def scan_saved_model(model_dir: str | os.PathLike[str], *, op_allow: Mapping[str, list[str]],
                     roots: list[str] | None = None, field: str = "model.path", origin: str | None = None) -> None:
    """Refuse the SavedModel in ``model_dir`` unless every op is allowed (cached per file mtime and size).

    ``origin`` is where the model was named, when ``model_dir`` is a local copy of it (an ``s3://`` URL: the
    worker's download, ``worker/model_download.py``): the operator's settings per root apply to it.
    Raises ``ModelRefused`` naming ``field``, the first refused op, its node and function, and the
    ``JACOBIAN_MODEL_OP_ALLOW`` setting that would allow it (for the model root of ``roots`` it lies
    in); ``SavedModelError`` when ``saved_model.pb`` is missing or cannot be decoded.
    """
    pb = Path(model_dir) / SAVED_MODEL_FILE
    try:
        st = pb.stat()
        graph = _graph_cached(str(pb), st.st_mtime_ns, st.st_size)
    except OSError:
        raise SavedModelError(f"no readable {SAVED_MODEL_FILE} in {str(origin or model_dir)!r}") from None
    except (SavedModelError, UnicodeDecodeError) as exc:
        raise SavedModelError(f"{str(pb)!r} is not a readable SavedModel: {exc}") from None
    check_graph(graph, origin or model_dir, op_allow=op_allow, roots=roots, field=field)


def check_graph(graph: GraphOps, where: str | os.PathLike[str], *, op_allow: Mapping[str, list[str]],
                roots: list[str] | None = None, field: str = "model.path") -> None:
    """Refuse (``ModelRefused``) the parsed graph of the model at ``where`` (a path or an ``s3://`` URL, for the
    operator's ``op_allow`` and the root a refusal names) unless every op is allowed."""
    extra, allowed_root = extra_ops(where, op_allow)
    refusals = refused_ops(graph, extra=extra)
    if refusals:
        raise ModelRefused(refusals, field=field, root=allowed_root or _root_of(where, roots or []))


def _root_of(model_dir: str | os.PathLike[str], roots: list[str]) -> str | None:
    for root in roots:
        if is_under(model_dir, root):
            return _shown(root)
    return None
