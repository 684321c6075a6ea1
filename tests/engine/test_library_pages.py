"""TensorFlow's libraries' pages handed back after the engine's import (``worker/engine/library_pages.py``), in a
fresh interpreter: the resident set falls, the pages that are the process's own stay, and TensorFlow computes the
same after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20

CODE = """
import json, os, sys
from worker.engine import library_pages
from worker.engine.host_peak import freeze_imports, status_bytes

calls, release = [], library_pages.release
def recorded(*args):
    calls.append('tensorflow.python._pywrap_tensorflow_internal' in sys.modules)
    return release(*args)
library_pages.release = recorded
freeze_imports()
peak_kib = status_bytes('VmHWM') // 1024
def tf_libraries():
    with open('/proc/self/smaps') as fh:
        return [m for m in library_pages.mappings(fh.read()) if 'libtensorflow' in m.path]
libs = tf_libraries()
import numpy as np
import tensorflow as tf
rng = np.random.default_rng(0)
w, x = rng.standard_normal((64, 32)), rng.standard_normal((8, 64))
xt = tf.constant(x)
with tf.GradientTape() as tape:
    tape.watch(xt)
    y = tf.reduce_sum(tf.tanh(xt @ tf.constant(w)) ** 2)
got = tape.gradient(y, xt).numpy()
want = (2 * np.tanh(x @ w) * (1 - np.tanh(x @ w) ** 2)) @ w.T
print(json.dumps({'calls': calls, 'peak_kib': peak_kib, 'clean_kib': sum(m.rss_kib for m in libs if m.releasable),
                  'own_kib': sum(m.rss_kib for m in libs if m.own_kib),
                  'own_mappings': sum(1 for m in libs if m.own_kib),
                  'file_kib': sum(m.rss_kib for m in libs), 'close': bool(np.allclose(got, want, rtol=1e-10)),
                  'after_gradient_kib': sum(m.rss_kib for m in tf_libraries())}))
"""


def _run(release: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JACOBIAN_RELEASE_LIBRARY_PAGES": release})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engines_import_hands_back_tensorflows_library_pages_and_keeps_its_own():
    kept, released = _run("0"), _run("1")
    # Loading TensorFlow leaves hundreds of MiB of its libraries resident (380 MiB with TensorFlow 2.21)...
    assert kept["clean_kib"] * 1024 > 150 * MIB, kept
    # ... which the engine's import hands back: what is left of them is what the import read after the release.
    assert released["clean_kib"] * 4 < kept["clean_kib"], (kept, released)
    # As TensorFlow's import starts (the libraries loaded before it), once its libraries are loaded, after the import.
    assert released["calls"] == kept["calls"] == [False, True, True]
    # Released as soon as the libraries are loaded, before TensorFlow's Python modules (90 MiB) are imported on top.
    assert (kept["peak_kib"] - released["peak_kib"]) * 1024 > 40 * MIB, (kept, released)
    # The relocated read-only segment (RELRO) and the data are the process's own pages: never released.
    assert released["own_mappings"] == kept["own_mappings"] >= 1
    assert abs(released["own_kib"] - kept["own_kib"]) * 1024 < 8 * MIB, (kept, released)
    # TensorFlow maps back from the page cache what it reads again, and computes the same.
    assert released["close"] and kept["close"]
    assert released["after_gradient_kib"] > released["file_kib"]
