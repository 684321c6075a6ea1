"""The ops of a SavedModel's graph and of every function in its library, read from ``saved_model.pb``
without TensorFlow.

Walks ``SavedModel.meta_graphs[0].graph_def``: its top-level ``node`` and ``library.function`` (each
``FunctionDef``'s ``node_def``), recording per node its op and the functions its attributes name
(``f``, ``body``, ``then_branch``: a ``func`` attribute or a list of them). Field numbers are those of
``tensorflow/core/framework/{graph,node_def,function,attr_value,op_def}.proto`` and
``tensorflow/core/protobuf/{saved_model,meta_graph}.proto``.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.savedmodel import SavedModelError, map_entry, proto_fields

# SavedModel / MetaGraphDef / GraphDef / FunctionDefLibrary / FunctionDef / OpDef
_SM_META_GRAPHS = 2
_MG_GRAPH_DEF, _MG_SAVER_DEF = 2, 3
_SD_SAVE_TENSOR, _SD_RESTORE_OP = 2, 3  # SaverDef
_GD_NODE, _GD_LIBRARY = 1, 2
_FL_FUNCTION = 1
_FD_SIGNATURE, _FD_NODE_DEF = 1, 3
_OD_NAME = 1
# NodeDef / AttrValue / AttrValue.ListValue / NameAttrList
_ND_NAME, _ND_OP, _ND_ATTR = 1, 2, 5
_AV_LIST, _AV_FUNC = 1, 10
_LV_FUNC = 9
_NA_NAME, _NA_ATTR = 1, 2

TOP_LEVEL = ""  # the "function" of the graph's own top-level nodes


@dataclass(frozen=True)
class GraphNode:
    """One ``NodeDef``: its name, its op, and the library functions its attributes name."""

    name: str
    op: str
    calls: tuple[str, ...] = ()


@dataclass(frozen=True)
class GraphOps:
    """Every node of a SavedModel: ``functions[name]`` for each library function, ``functions[TOP_LEVEL]``
    for the graph's own nodes (in TF2 exports, the saver's)."""

    functions: dict[str, tuple[GraphNode, ...]]
    saver_nodes: tuple[str, ...] = ()  # the top-level nodes ``saver_def`` names: its save and restore ops

    def reachable(self, roots: list[str] | tuple[str, ...]) -> set[str]:
        """The functions ``roots`` are or call, directly or through others (op names that are functions count)."""
        seen: set[str] = set()
        todo = [r for r in roots if r in self.functions]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for node in self.functions[name]:
                todo.extend(c for c in (*node.calls, node.op) if c in self.functions and c not in seen)
        return seen


def _text(value: memoryview) -> str:
    return bytes(value).decode("utf-8", "replace")


def _func_names(attr_value: memoryview) -> list[str]:
    """The function names in one ``AttrValue``: its ``func`` and the ``func`` entries of its ``list``,
    and those named by their own attributes (a function passed with attributes that are functions)."""
    names: list[str] = []
    for number, wire, value in proto_fields(attr_value):
        if wire != 2:
            continue
        if number == _AV_FUNC:
            names.extend(_name_attr_list(value))
        elif number == _AV_LIST:
            for n, w, v in proto_fields(value):
                if n == _LV_FUNC and w == 2:
                    names.extend(_name_attr_list(v))
    return names


def _name_attr_list(buf: memoryview) -> list[str]:
    names: list[str] = []
    for number, wire, value in proto_fields(buf):
        if number == _NA_NAME and wire == 2:
            names.append(_text(value))
        elif number == _NA_ATTR and wire == 2:
            names.extend(_func_names(map_entry(value)[1]))
    return names


def _node(buf: memoryview) -> GraphNode:
    name, op, calls = "", "", []
    for number, wire, value in proto_fields(buf):
        if wire != 2:
            continue
        if number == _ND_NAME:
            name = _text(value)
        elif number == _ND_OP:
            op = _text(value)
        elif number == _ND_ATTR:
            calls.extend(_func_names(map_entry(value)[1]))
    return GraphNode(name=name, op=op, calls=tuple(dict.fromkeys(calls)))


def _function(buf: memoryview) -> tuple[str, tuple[GraphNode, ...]]:
    name, nodes = "", []
    for number, wire, value in proto_fields(buf):
        if number == _FD_SIGNATURE and wire == 2:
            name = next((_text(v) for n, w, v in proto_fields(value) if n == _OD_NAME and w == 2), "")
        elif number == _FD_NODE_DEF and wire == 2:
            nodes.append(_node(value))
    return name, tuple(nodes)


def parse_graph_ops(data: bytes) -> GraphOps:
    """Decode the bytes of ``saved_model.pb``: the nodes of ``meta_graphs[0]``'s graph and of every function
    in its library. Raises ``SavedModelError`` when the bytes are not a SavedModel with a meta graph."""
    meta_graph = next((v for n, w, v in proto_fields(memoryview(data)) if n == _SM_META_GRAPHS and w == 2), None)
    if meta_graph is None:
        raise SavedModelError("no meta graph in saved_model.pb")
    functions: dict[str, tuple[GraphNode, ...]] = {TOP_LEVEL: ()}
    saver: list[str] = []
    for number, wire, graph in proto_fields(meta_graph):
        if number == _MG_SAVER_DEF and wire == 2:
            saver.extend(_node_name(_text(v)) for n, w, v in proto_fields(graph)
                         if n in (_SD_SAVE_TENSOR, _SD_RESTORE_OP) and w == 2)
        if number != _MG_GRAPH_DEF or wire != 2:
            continue
        top: list[GraphNode] = []
        for n, w, v in proto_fields(graph):
            if n == _GD_NODE and w == 2:
                top.append(_node(v))
            elif n == _GD_LIBRARY and w == 2:
                for fn_n, fn_w, fn_v in proto_fields(v):
                    if fn_n == _FL_FUNCTION and fn_w == 2:
                        name, nodes = _function(fn_v)
                        if name in functions:
                            raise SavedModelError(f"function {name!r} is defined twice in the library")
                        functions[name] = nodes
        functions[TOP_LEVEL] = (*functions[TOP_LEVEL], *top)
    return GraphOps(functions=functions, saver_nodes=tuple(saver))


def _node_name(tensor: str) -> str:
    """``"StatefulPartitionedCall_2:0"`` or ``"^save/restore_all"`` -> the node's name."""
    return tensor.removeprefix("^").rpartition(":")[0] if ":" in tensor else tensor.removeprefix("^")
