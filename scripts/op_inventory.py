"""Every op of the SavedModels the tests build and of the architectures users bring, per model (a dev tool).

Builds the models of ``tests/models.py`` and ``tests/sparse_models.py``, Keras applications with
``weights=None`` (exported by ``Model.export`` and by ``tf.saved_model.save``), an LSTM, a GRU, a Conv1D
net and a small transformer encoder, parses each ``saved_model.pb`` with ``contracts.graph_ops`` and
prints the ops that ``contracts/op_allowlist.txt`` does not allow (``--all``: every op, with the models
that use it). Run: ``PYTHONPATH=. python scripts/op_inventory.py [--only NAME,...] [--all] [--fast]``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def _user_models(fast: bool) -> dict[str, Callable[[Path], object]]:
    import keras
    import tensorflow as tf

    def export(build: Callable[[], keras.Model], how: str) -> Callable[[Path], object]:
        def save(path: Path) -> None:
            model = build()
            if how == "export":
                model.export(str(path), verbose=False)
            else:
                tf.saved_model.save(model, str(path))
        return save

    def app(cls_name: str, size: int) -> Callable[[], keras.Model]:
        return lambda: getattr(keras.applications, cls_name)(weights=None, input_shape=(size, size, 3))

    def lstm() -> keras.Model:
        inp = keras.Input((7, 3), name="seq")
        return keras.Model(inp, keras.layers.Dense(2)(keras.layers.LSTM(5)(inp)))

    def gru() -> keras.Model:
        inp = keras.Input((7, 3), name="seq")
        return keras.Model(inp, keras.layers.GRU(5, return_sequences=True)(inp))

    def conv1d() -> keras.Model:
        inp = keras.Input((16, 2), name="signal")
        h = keras.layers.Conv1D(4, 3, activation="relu", padding="causal", dilation_rate=2)(inp)
        h = keras.layers.MaxPooling1D(2)(keras.layers.BatchNormalization()(h))
        return keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))

    def transformer() -> keras.Model:
        inp = keras.Input((6, 8), name="tokens")
        att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
        h = keras.layers.LayerNormalization()(inp + keras.layers.Dropout(0.1)(att))
        ff = keras.layers.Dense(8)(keras.layers.Dense(16, activation="gelu")(h))
        return keras.Model(inp, keras.layers.LayerNormalization()(h + ff))

    built: dict[str, Callable[[], keras.Model]] = {"lstm": lstm, "gru": gru, "conv1d": conv1d,
                                                    "transformer": transformer}
    if not fast:
        built |= {"mobilenet_v3_small": app("MobileNetV3Small", 64), "efficientnet_b0": app("EfficientNetB0", 64),
                  "resnet50": app("ResNet50", 64)}
    out = {}
    for name, build in built.items():
        out[f"{name}.export"] = export(build, "export")
        out[f"{name}.saved_model_save"] = export(build, "save")
    return out


def builders(fast: bool) -> dict[str, Callable[[Path], object]]:
    """Every model this inventory builds, by name."""
    from tests import models, sparse_models

    out: dict[str, Callable[[Path], object]] = {f"models.{k}": v for k, v in models.BUILDERS.items()}
    for module in (models, sparse_models):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            params = list(inspect.signature(fn).parameters)
            if fn.__module__ == module.__name__ and params[:1] == ["path"] and not name.startswith("_"):
                out.setdefault(f"{module.__name__.split('.')[-1]}.{name}", fn)
    return out | _user_models(fast)


def main() -> int:
    from contracts.graph_ops import parse_graph_ops
    from contracts.graph_scan import allowlist

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--fast", action="store_true", help="no keras.applications")
    args = parser.parse_args()
    chosen = builders(args.fast)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    allowed = allowlist().every_op
    users: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in chosen.items():
            path = Path(tmp) / name
            build(path)
            ops = parse_graph_ops((path / "saved_model.pb").read_bytes())
            for nodes in ops.functions.values():
                for node in nodes:
                    if node.op not in ops.functions:
                        users.setdefault(node.op, set()).add(name)
            print(f"built {name}", file=sys.stderr, flush=True)
    for op in sorted(users):
        if args.all or op not in allowed:
            print(f"{op}\t{'' if op in allowed else 'NOT ALLOWED'}\t{','.join(sorted(users[op]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
