"""TensorFlow imported by the engine without Keras and JAX, which a later import still gets (engine/tf_import.py).

Each check runs in a fresh interpreter: what a process imports first decides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plain_tensorflow_imports_keras_and_jax(tmp_path):
    """The cost the engine avoids exists: ``import tensorflow`` alone imports Keras (and JAX, installed with the
    test extras). If this fails, TensorFlow no longer imports them and ``tf_import`` can go."""
    seen = _python("import sys, json, importlib.util\nimport tensorflow\n"
                   "print(json.dumps({'keras': 'keras' in sys.modules, 'jax': 'jax' in sys.modules,"
                   " 'jax_installed': importlib.util.find_spec('jax') is not None}))", tmp_path)
    assert seen["keras"]
    assert seen["jax"] == seen["jax_installed"]


def test_the_engine_imports_tensorflow_without_keras_and_jax_and_a_keras_model_still_loads(tmp_path):
    code = """
import sys, json
import numpy as np
from worker.engine import load_model
import tensorflow as tf
after_tf = {'keras': 'keras' in sys.modules, 'jax': 'jax' in sys.modules}
import keras   # an ordinary import now
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name='d')])
path = sys.argv[1] + '/m.keras'
model.save(path)
loaded = load_model(path)
x = np.ones((1, 3), np.float32)
got = loaded.fn(**{next(iter(loaded.input_specs)): tf.constant(x)})
y = np.asarray(next(iter(got.values())))
layer = tf.keras.layers.Dense(4)   # TensorFlow's lazy tf.keras still resolves
print(json.dumps({**after_tf, 'same': bool(np.allclose(y, model(x).numpy())),
                  'tf_keras_layer': type(layer).__name__}))
"""
    seen = _python(code, tmp_path)
    assert seen == {"keras": False, "jax": False, "same": True, "tf_keras_layer": "Dense"}


def test_keras_imported_before_the_engine_is_left_alone(tmp_path):
    """Keras imports TensorFlow itself: the engine then installs nothing and everything is as before."""
    seen = _python("import sys, json\nimport keras\nimport worker.engine\nimport tensorflow as tf\n"
                   "from worker.engine.tf_import import _FINDER\n"
                   "print(json.dumps({'keras': 'keras' in sys.modules, 'finder': _FINDER in sys.meta_path,"
                   " 'sum': float(tf.reduce_sum(keras.layers.Dense(2, kernel_initializer='ones')(tf.ones((1, 3)))))}))",
                   tmp_path)
    assert seen == {"keras": True, "finder": False, "sum": 6.0}


REGISTRIES = """
import json, sys
from tensorflow.python.framework import ops, type_spec_registry
from tensorflow.python.ops.parallel_for import pfor
from tensorflow.python.saved_model import nested_structure_coder, revived_types
def registries():
    return {"gradients": sorted(ops._gradient_registry.list()),
            "type_specs": sorted(type_spec_registry._TYPE_SPEC_TO_NAME.values()),
            "revived_types": sorted(revived_types._REVIVED_TYPE_REGISTRY),
            "pfor_converters": sorted(str(k) for k in pfor._pfor_converter_registry),
            "codecs": sorted(type(c).__name__ for c in nested_structure_coder._codecs)}
"""


def _registered(tmp_path: Path, before: str, after: str = "") -> dict:
    return _python(before + REGISTRIES + after + "print(json.dumps(registries()))", tmp_path)


def test_lazy_namespaces_register_what_a_full_import_does_but_the_skipped_registrations(tmp_path):
    """What TensorFlow registers on import (gradients, type specs for signatures, the loader's revived types, pfor's
    converters, the structure coder's codecs) is a full import's, less ``SKIPPED_REGISTRATIONS`` exactly, once a
    SavedModel is loaded as the engine loads one; ``complete()`` registers those too. A TensorFlow that registers
    something else from a lazy namespace fails here, naming it."""
    from tests import models
    from worker.engine.tf_import import SKIPPED_REGISTRATIONS

    path = models.mlp(tmp_path / "mlp")
    full = _registered(tmp_path, "import tensorflow\n")
    lazy = _registered(tmp_path, f"from worker.engine import load_model\nload_model({str(path)!r})\n")
    done = _registered(tmp_path, f"from worker.engine import load_model, tf_import\nload_model({str(path)!r})\n"
                                 "tf_import.complete()\n")
    missing = {kind: sorted(set(full[kind]) - set(lazy[kind])) for kind in full}
    assert {name for names in missing.values() for name in names} == set(SKIPPED_REGISTRATIONS), missing
    assert all(set(full[kind]) <= set(done[kind]) for kind in full)


SHOW_OPTIMIZER = ("print(json.dumps({'optimizer': type(model.loaded.opt).__name__,"
                  " 'left': len(tf_import.lazy_left())}))")


def test_a_savedmodel_that_names_a_skipped_registration_loads(tmp_path):
    """A SavedModel that kept TensorFlow's Keras 2 optimizer (``tf_deprecated_optimizer``, registered only by a
    module no namespace of the import runs) loads: ``load_model`` finds the name and runs the namespaces first."""
    code = """
import sys, json
from worker.engine import load_model, tf_import
import tensorflow as tf
from tensorflow.python.keras.optimizer_v2 import adam
class M(tf.Module):
    def __init__(self):
        self.w = tf.Variable(tf.ones([3, 2]))
        self.opt = adam.Adam()
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def __call__(self, x):
        return {"y": tf.tanh(x @ self.w)}
m = M()
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(m(tf.ones([1, 3]))["y"])
m.opt.apply_gradients([(tape.gradient(loss, m.w), m.w)])
tf.saved_model.save(m, sys.argv[1] + "/opt", signatures={"serving_default": m.__call__})
print(json.dumps({"names": tf_import.names_a_skipped_registration(sys.argv[1] + "/opt")}))
"""
    assert _python(code, tmp_path) == {"names": True}
    full = _python("import sys, json\nimport tensorflow as tf\nmodel = tf.saved_model.load(sys.argv[1] + '/opt')\n"
                   "print(json.dumps({'optimizer': type(model.opt).__name__}))", tmp_path)
    seen = _python("import sys, json\nfrom worker.engine import load_model, tf_import\n"
                   "model = load_model(sys.argv[1] + '/opt')\n" + SHOW_OPTIMIZER,
                   tmp_path)
    assert full["optimizer"] != "_UserObject"   # what a load without the registration makes of it
    assert seen == {"optimizer": full["optimizer"], "left": 0}
    # a registration the byte search misses: the load fails with the namespaces lazy, and is tried again after them
    retried = _python("import sys, json\nfrom worker.engine import load_model, tf_import\n"
                      "tf_import.names_a_skipped_registration = lambda path: False\n"
                      "model = load_model(sys.argv[1] + '/opt')\n" + SHOW_OPTIMIZER,
                      tmp_path)
    assert retried == seen


@pytest.mark.parametrize("model", ["mlp", "rk4"])
def test_a_job_leaves_the_v1_api_and_internals_lazy_and_jax_unimported(tmp_path, model):
    """A whole ``jacobian compute`` runs none of ``tf.compat`` (the v1 API: 1,200 modules), ``tf.__internal__``,
    ``tf.data``, ``tf.distribute`` or ``tf.lite`` (which would import JAX): the engine reaches ``tf.compat.v1``'s
    graph tools by their modules. A ``tf.compat.v1.X`` in the engine fails here. The RK4 integrator's
    ``while_loop`` makes pfor convert a function call with AutoGraph, whose source lookup reads every module's
    ``__file__``: that leaves a namespace lazy."""
    import numpy as np

    from tests import loop_models, models

    if model == "mlp":
        path = models.mlp(tmp_path / "mlp")
        np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    else:
        path = loop_models.rk4(tmp_path / "rk4")
        np.savez(tmp_path / "in.npz", x0=np.linspace(-1.0, 1.0, 4))
    code = f"""
import sys, json
from jacobian.cli import main
rc = main(["compute", "--model", {str(path)!r}, "--input", {str(tmp_path / "in.npz")!r}, "--out",
           {str(tmp_path / "out")!r}, "--job-id", "j"])
from worker.engine import tf_import
print(json.dumps({{"rc": rc, "left": tf_import.lazy_left(), "jax": "jax" in sys.modules,
                  "keras": "keras" in sys.modules}}))
"""
    seen = _python(code, tmp_path)
    assert seen["rc"] == 0 and not seen["jax"] and not seen["keras"]
    api = "tensorflow._api.v2."
    for namespace in ("compat", "__internal__", "data", "distribute", "lite"):
        assert api + namespace in seen["left"], namespace


def test_a_lazy_namespace_read_by_threads_at_once_is_run_once(tmp_path):
    seen = _python("""
import sys, json, threading
import worker.engine
from worker.engine import tf_import
import tensorflow as tf
name = "tensorflow._api.v2.signal"
lazy_before = name in tf_import.lazy_left()
start, got, errors = threading.Barrier(8), [], []
def read():
    start.wait()
    try:
        got.append(tf.signal.fft is not None)
    except Exception as err:
        errors.append(repr(err))
threads = [threading.Thread(target=read) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"lazy_before": lazy_before, "got": got, "errors": errors, "left": name in tf_import.lazy_left()}))
""", tmp_path)
    assert seen == {"lazy_before": True, "got": [True] * 8, "errors": [], "left": False}


def test_eager_api_turns_the_lazy_namespaces_off(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import json\nfrom worker.engine import tf_import\nimport tensorflow\n"
                           "print(json.dumps(tf_import.lazy_left()))"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JACOBIAN_TF_EAGER_API": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_reading_a_namespaces_file_leaves_it_lazy_and_a_failed_run_is_run_again(tmp_path):
    """``__file__`` and the other names a module has before its code runs do not run a namespace
    (``inspect.getmodule`` reads them on every module); a run interrupted midway leaves the namespace lazy as it
    was, and the next read runs it whole."""
    seen = _python("""
import sys, json, inspect
import worker.engine
from worker.engine import tf_import
import tensorflow as tf
name = "tensorflow._api.v2.signal"
module = sys.modules[name]
_ = (module.__file__, module.__name__, module.__spec__, module.__path__)
inspect.getmodule(json.dumps)
after_dunders = name in tf_import.lazy_left()
loader = module.__spec__.loader
real = loader.exec_module
def interrupted(m):
    raise KeyboardInterrupt
loader.exec_module = interrupted
try:
    tf.signal.fft
    first = "ran"
except KeyboardInterrupt:
    first = "interrupted"
still_lazy = name in tf_import.lazy_left()
loader.exec_module = real
second = tf.signal.fft is not None
print(json.dumps({"after_dunders": after_dunders, "first": first, "still_lazy": still_lazy, "second": second,
                  "left_after": name in tf_import.lazy_left()}))
""", tmp_path)
    assert seen == {"after_dunders": True, "first": "interrupted", "still_lazy": True, "second": True,
                    "left_after": False}


def test_other_threads_see_the_namespaces_while_the_rest_run(tmp_path):
    """While ``complete()`` runs every namespace, another thread reading ``tf.distribute`` and ``tf.lite`` (as
    Keras's training loop reads ``tf.distribute``) always finds the namespaces, never TensorFlow's packages of
    those names."""
    seen = _python("""
import sys, json, threading
import worker.engine
from worker.engine import tf_import
import tensorflow as tf
tf.distribute.has_strategy(), tf.lite.Interpreter   # run these two first
stop, errors, reads = threading.Event(), [], [0]
def read():
    while not stop.is_set():
        try:
            tf.distribute.has_strategy(); tf.lite.Interpreter
            reads[0] += 1
        except AttributeError as err:
            errors.append(str(err))
reader = threading.Thread(target=read)
reader.start()
tf_import.complete()
stop.set(); reader.join()
print(json.dumps({"errors": sorted(set(errors))[:3], "read": reads[0] > 0, "left": tf_import.lazy_left()}))
""", tmp_path)
    assert seen == {"errors": [], "read": True, "left": []}


def test_no_other_tensorflow_module_reads_a_package_through_a_namespaces_name():
    """``import tensorflow.<name>.x.y as z`` reads ``tf.<name>`` as an attribute, which is a namespace once TensorFlow
    is imported: where ``<name>`` is also a package of TensorFlow's, every module that does so must be in
    ``READ_THROUGH_PACKAGE`` (imported while the package is still bound). A TensorFlow that adds one fails here."""
    import importlib.util
    import re

    from worker.engine.tf_import import READ_THROUGH_PACKAGE

    root = Path(importlib.util.find_spec("tensorflow").origin).parent
    shared = [p.name for p in root.iterdir()
              if (p / "__init__.py").is_file() and (root / "_api" / "v2" / p.name).is_dir()]
    assert set(shared) == {"distribute", "lite"}, shared
    pattern = re.compile(rf"^\s*import tensorflow\.({'|'.join(shared)})\.[\w.]+ as ", re.M)
    found = {}
    for path in root.rglob("*.py"):
        if "_api" in path.parts or path.name.endswith("_test.py"):
            continue
        for match in pattern.finditer(path.read_text(errors="replace")):
            module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
            found.setdefault(match.group(1), set()).add(module)
    assert found == {k: set(v) for k, v in READ_THROUGH_PACKAGE.items()}
