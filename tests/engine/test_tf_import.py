"""TensorFlow imported by the engine without Keras and JAX, which a later import still gets (engine/tf_import.py).

Each check runs in a fresh interpreter: what a process imports first decides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_a_job_leaves_the_v1_api_and_internals_lazy_and_jax_unimported(tmp_path):
    """A whole ``jacobian compute`` runs none of ``tf.compat`` (the v1 API: 1,200 modules), ``tf.__internal__``,
    ``tf.data``, ``tf.distribute`` or ``tf.lite`` (which would import JAX): the engine reaches ``tf.compat.v1``'s
    graph tools by their modules. A ``tf.compat.v1.X`` in the engine fails here."""
    import numpy as np

    from tests import models

    path = models.mlp(tmp_path / "mlp")
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
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
