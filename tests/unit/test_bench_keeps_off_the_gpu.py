"""A benchmark's own process hides the GPU from its TensorFlow before it builds a model: on an H100, TensorFlow in
``bench_cold``'s parent (which only builds the model and compares arrays) reserved nearly all of the GPU at its first
op, and the JAX peer, a child process, ran out of memory at a 1x1 convolution (docs/BENCHMARKS.md, "GPU
again"). This machine has no GPU, so the calls TensorFlow receives are what is checked."""

from __future__ import annotations

import tensorflow as tf

from bench import common
from bench.bench_cold import build_model


def test_build_model_hides_the_gpu_before_it_builds(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(tf.config, "set_visible_devices", lambda devices, kind=None: calls.append((devices, kind)))
    built = []

    import tests.models as models

    original_mlp = models.mlp
    monkeypatch.setattr(models, "mlp", lambda *a, **k: built.append(list(calls)) or original_mlp(*a, **k))
    model_dir, of, wrt = build_model("mlp", tmp_path)
    assert (model_dir.exists(), of, wrt) == (True, "y", "x")
    assert built == [[([], "GPU")]], "the GPU was not hidden before the model was built"


def test_a_process_that_already_made_its_devices_says_so(monkeypatch, capsys):
    def refuse(devices, kind=None):
        raise RuntimeError("Visible devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config, "set_visible_devices", refuse)
    common.keep_off_the_gpu()
    err = capsys.readouterr().err
    assert "keeps the GPU" in err and "cannot be modified" in err


def test_hiding_again_in_the_same_process_is_silent(capsys):
    common.keep_off_the_gpu()
    common.keep_off_the_gpu()
    assert capsys.readouterr().err == ""
