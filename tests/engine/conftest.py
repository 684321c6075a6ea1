"""Engine fixtures: every test model built once per session, loaded once."""

from __future__ import annotations

import numpy as np
import pytest

from tests import models


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: build(root / name) for name, build in models.BUILDERS.items()}


def loader(paths):
    """``get(name)``: the model saved at ``paths[name]``, loaded on first use and then kept."""
    from worker.engine import load_model

    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(str(paths[name]))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def loaded(model_dir):
    return loader(model_dir)


def rand(shape, dtype="float32", seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)
