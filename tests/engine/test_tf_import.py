"""TensorFlow imported by the engine without Keras and JAX, which a later import still gets (engine/tf_import.py).

Each check runs in a fresh interpreter: what a process imports first decides."""

from __future__ import annotations

import json
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
from worker.engine.tf_import import _FINDER
import tensorflow as tf
after_tf = {'keras': 'keras' in sys.modules, 'jax': 'jax' in sys.modules}
import keras   # an ordinary import now: the finder steps aside
finder_left = _FINDER in sys.meta_path
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name='d')])
path = sys.argv[1] + '/m.keras'
model.save(path)
loaded = load_model(path)
x = np.ones((1, 3), np.float32)
got = loaded.fn(**{next(iter(loaded.input_specs)): tf.constant(x)})
y = np.asarray(next(iter(got.values())))
layer = tf.keras.layers.Dense(4)   # TensorFlow's lazy tf.keras still resolves
print(json.dumps({**after_tf, 'finder_left': finder_left, 'same': bool(np.allclose(y, model(x).numpy())),
                  'tf_keras_layer': type(layer).__name__}))
"""
    seen = _python(code, tmp_path)
    assert seen == {"keras": False, "jax": False, "finder_left": False, "same": True, "tf_keras_layer": "Dense"}


def test_keras_imported_before_the_engine_is_left_alone(tmp_path):
    """Keras imports TensorFlow itself: the engine then installs nothing and everything is as before."""
    seen = _python("import sys, json\nimport keras\nimport worker.engine\nimport tensorflow as tf\n"
                   "from worker.engine.tf_import import _FINDER\n"
                   "print(json.dumps({'keras': 'keras' in sys.modules, 'finder': _FINDER in sys.meta_path,"
                   " 'sum': float(tf.reduce_sum(keras.layers.Dense(2, kernel_initializer='ones')(tf.ones((1, 3)))))}))",
                   tmp_path)
    assert seen == {"keras": True, "finder": False, "sum": 6.0}
