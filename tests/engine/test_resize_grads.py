"""Second derivatives and forward mode through image resizing (``worker.engine.resize_grads``). TensorFlow 2.21
registers ``ResizeBilinearGrad`` as not differentiable, so a Hessian, an HVP or a forward-mode JVP through a bilinear
resize came back as zeros, silently (the eager nested-tape reference agreed), and through bicubic and nearest-
neighbour resizing they failed. Here every one equals its reference from the explicit resize matrix R (the resize
of each unit image): y = tanh(W R x) has J = diag(tanh') W R and, for the sum of y, H = Rᵀ Wᵀ diag(tanh'') W R."""

from __future__ import annotations

import numpy as np
import pytest

from tests import loop_models
from tests.engine.conftest import loader

SIDE, OUT = 3, 4
IMAGES = np.random.default_rng(6).standard_normal((2, SIDE, SIDE, 1)).astype("float32")
METHODS = ("bilinear", "bicubic", "nearest")


@pytest.fixture(scope="module")
def resize_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("resize")
    return loader({m: loop_models.resize(root / m, side=SIDE, out=OUT, method=m) for m in METHODS})


def reference(model, method: str) -> tuple[np.ndarray, np.ndarray]:
    """J (2*OUT, 2*SIDE*SIDE) and the Hessian of sum(y) over both images, from R and the model's W in float64."""
    import tensorflow as tf

    n = SIDE * SIDE
    r = np.stack([tf.image.resize(np.eye(n)[i].reshape(1, SIDE, SIDE, 1).astype("float32"), [2 * SIDE, 2 * SIDE],
                                  method=method).numpy().ravel() for i in range(n)], 1).astype(np.float64)
    w = model.loaded.w.numpy().astype(np.float64)
    jac = np.zeros((2 * OUT, 2 * n))
    hess = np.zeros((2 * n, 2 * n))
    for b in range(2):
        z = w.T @ r @ IMAGES[b].ravel().astype(np.float64)
        t = np.tanh(z)
        jac[b * OUT:(b + 1) * OUT, b * n:(b + 1) * n] = np.diag(1 - t ** 2) @ w.T @ r
        hess[b * n:(b + 1) * n, b * n:(b + 1) * n] = r.T @ w @ np.diag(-2 * t * (1 - t ** 2)) @ w.T @ r
    return jac, hess


@pytest.mark.parametrize("method", METHODS)
def test_hvp_hessian_and_forward_jvp_through_a_resize_equal_the_explicit_matrix(resize_model, method):
    from worker.engine import compute_in_memory
    from worker.engine.matfree import build_operator

    model = resize_model(method)
    jac, hess = reference(model, method)
    assert np.abs(hess).max() > 0.1   # a Hessian that zeros would not match
    seeds = np.random.default_rng(7).standard_normal((3, 2 * SIDE * SIDE)).astype("float32")

    op = build_operator(model, {"x": IMAGES}, of="y", wrt="x", kind="hvp", reduce="sum")
    np.testing.assert_allclose(op.hvp(seeds), seeds @ hess, rtol=1e-4, atol=1e-5 * np.abs(hess).max())
    assert not op.labels["hvp"].startswith("reverse/rows"), op.labels

    dense, _ = compute_in_memory(model, {"x": IMAGES}, of="y", wrt="x", kind="hessian", reduce="sum")
    np.testing.assert_allclose(np.asarray(dense).reshape(hess.shape), hess, rtol=1e-4,
                               atol=1e-5 * np.abs(hess).max())

    forward = build_operator(model, {"x": IMAGES}, of="y", wrt="x", kind="jvp", routes={"jvp": "forward"})
    np.testing.assert_allclose(forward.jvp(seeds).reshape(3, -1), seeds @ jac.T, rtol=1e-4,
                               atol=1e-5 * np.abs(jac).max())
    assert forward.labels["jvp"].startswith("forward/"), forward.labels


def test_install_replaces_the_not_differentiable_entry():
    import tensorflow as tf
    from tensorflow.python.framework import ops

    from worker.engine import resize_grads

    resize_grads.install()
    for name in resize_grads.GRADIENTS:
        assert ops.gradient_registry.lookup(name) is resize_grads.GRADIENTS[name]
    x = tf.constant(IMAGES)
    with tf.GradientTape() as outer:   # eager nested tapes, as a user's reference would run
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(tf.tanh(tf.image.resize(x, [6, 6])))
        g = inner.gradient(y, x)
    assert outer.gradient(g, x) is not None
