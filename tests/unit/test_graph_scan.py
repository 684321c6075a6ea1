"""contracts.graph_scan: the ops of every function of a SavedModel, and the refused (op, node, function)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.graph_ops import TOP_LEVEL, GraphNode, GraphOps, parse_graph_ops
from contracts.graph_scan import (
    ModelRefused,
    Refusal,
    allowlist,
    extra_ops,
    parse_allowlist,
    refused_ops,
    saver_functions,
    scan_saved_model,
)
from contracts.savedmodel import SavedModelError
from tests import hostile_models

# Ops the allowlist must never hold: file system, Python, network, process, summaries, datasets.
NEVER = ("ReadFile", "WriteFile", "MatchingFiles", "DeleteFile", "FileExists", "IsDirectory", "RecursivelyCreateDir",
         "PyFunc", "PyFuncStateless", "EagerPyFunc", "PrintV2", "Print", "InitializeTableFromTextFileV2",
         "WriteSummary", "CreateSummaryFileWriter", "ImmutableConst", "TFRecordDataset", "FixedLengthRecordReaderV2",
         "_Send", "_Recv", "Send", "Recv", "CollectiveReduceV2", "RemoteCall", "DebugIdentityV3",
         "LoadTPUEmbeddingParameters")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("scanned")
    return {"writes": hostile_models.writes_file(base / "writes", base / "never-written.txt"),
            "reads": hostile_models.reads_file(base / "reads", base / "secret.txt"),
            "python": hostile_models.calls_python(base / "python"),
            "clean": hostile_models.clean(base / "clean")}


def _graph(path: Path) -> GraphOps:
    return parse_graph_ops((path / "saved_model.pb").read_bytes())


@pytest.mark.parametrize(("name", "op"), [("writes", "WriteFile"), ("reads", "ReadFile"), ("python", "EagerPyFunc")])
def test_each_family_is_refused_with_its_node_and_function(built, name, op):
    graph = _graph(built[name])
    refusals = refused_ops(graph)
    assert [r.op for r in refusals] == [op]
    node, function = refusals[0].node, refusals[0].function
    assert function.startswith("__inference___call__") and function in graph.functions
    assert any(n.name == node and n.op == op for n in graph.functions[function])


def test_a_clean_model_passes_and_its_saver_keeps_its_checkpoint_ops(built):
    graph = _graph(built["clean"])
    assert refused_ops(graph) == []
    saver = saver_functions(graph)
    assert saver and all("traced_save" in f or "traced_restore" in f for f in saver)
    ops_in_saver = {n.op for f in saver for n in graph.functions[f]}
    assert {"SaveV2", "RestoreV2", "MergeV2Checkpoints"} <= ops_in_saver
    # the same ops anywhere else are refused
    assert refused_ops(graph, allowed=parse_allowlist("## math\nMatMul\n")) != []


def test_checkpoint_ops_outside_the_saver_are_refused():
    graph = GraphOps(functions={
        TOP_LEVEL: (GraphNode("save", "StatefulPartitionedCall", ("save_fn",)),
                    GraphNode("serve", "StatefulPartitionedCall", ("serve_fn",))),
        "save_fn": (GraphNode("SaveV2", "SaveV2"),),
        "serve_fn": (GraphNode("x", "Placeholder"), GraphNode("write", "SaveV2"), GraphNode("call", "helper")),
        "helper": (GraphNode("restore", "RestoreV2"),)}, saver_nodes=("save",))
    assert refused_ops(graph) == [Refusal("SaveV2", "write", "serve_fn"), Refusal("RestoreV2", "restore", "helper")]
    # a saver function that the serving path calls too loses its licence
    shared = GraphOps(functions={**graph.functions, "serve_fn": (GraphNode("call", "PartitionedCall", ("save_fn",)),)},
                      saver_nodes=("save",))
    assert saver_functions(shared) == set()
    assert Refusal("SaveV2", "SaveV2", "save_fn") in refused_ops(shared)


def test_functions_named_in_attributes_and_ops_are_followed():
    graph = GraphOps(functions={TOP_LEVEL: (GraphNode("w", "While", ("cond", "body")),),
                                "cond": (GraphNode("c", "Less"),), "body": (GraphNode("b", "inner"),),
                                "inner": (GraphNode("r", "ReadFile"),)})
    assert graph.reachable([TOP_LEVEL]) == {TOP_LEVEL, "cond", "body", "inner"}
    assert refused_ops(graph) == [Refusal("ReadFile", "r", "inner")]
    assert refused_ops(graph, extra=frozenset({"ReadFile"})) == []


def test_the_operator_allows_ops_per_folder(built, tmp_path):
    root = built["reads"].parent
    with pytest.raises(ModelRefused) as err:
        scan_saved_model(built["reads"], op_allow={str(tmp_path): ["ReadFile"]}, roots=[str(root)], field="path")
    message = str(err.value)
    assert message.startswith("path: the model uses op 'ReadFile' (node 'ReadFile' in function '__inference___call__")
    assert f"JACOBIAN_MODEL_OP_ALLOW='{{\"{root.resolve()}\": [\"ReadFile\"]}}'" in message
    scan_saved_model(built["reads"], op_allow={str(root): ["ReadFile"]}, roots=[str(root)])  # allowed: no raise
    assert extra_ops(built["reads"], {str(root): ["A"], str(built["reads"]): ["B"], str(tmp_path): ["C"]}) == (
        frozenset({"A", "B"}), str(built["reads"].resolve()))


def test_an_unreadable_graph_is_refused_not_passed(tmp_path):
    (tmp_path / "saved_model.pb").write_bytes(b"\x12\x05abc")  # a meta graph field that runs past the end
    with pytest.raises(SavedModelError):
        scan_saved_model(tmp_path, op_allow={})
    with pytest.raises(SavedModelError):
        scan_saved_model(tmp_path / "absent", op_allow={})


def test_the_allowlist_holds_no_io_op_and_only_registered_ops():
    from tensorflow.python.framework import op_def_registry

    ops = allowlist().every_op
    assert len(ops) > 200
    assert not ops & set(NEVER)
    io_named = {op for op in ops if "File" in op or "Dataset" in op or "Reader" in op or "Py" in op}
    assert io_named == {"ShardedFilename", "ShardedFilespec"}  # string ops building checkpoint names (saver only)
    assert sorted(op for op in ops if op_def_registry.get(op) is None) == []
    assert allowlist().saver == {"SaveV2", "RestoreV2", "MergeV2Checkpoints", "ShardedFilename", "ShardedFilespec"}


def test_allowlist_format_errors_name_the_line():
    assert parse_allowlist("# c\n## a: x\nAbs  # why\n\n## b\nNeg\n").families == {"a": {"Abs"}, "b": {"Neg"}}
    assert set(allowlist().families) == {"graph", "calls", "control", "variables", "tensorlists", "array", "math",
                                         "reductions", "linalg", "nn", "random", "strings", "saver"}
    with pytest.raises(ValueError, match="op_allowlist.txt:2: '## two words' must be '## family: description'"):
        parse_allowlist("## a\n## two words\n")
    with pytest.raises(ValueError, match="op_allowlist.txt:1: 'Abs' must be one op name under a '## family' header"):
        parse_allowlist("Abs\n")
