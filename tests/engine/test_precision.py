"""A job's ``precision``: TensorFloat-32 off unless the job asks for "tf32", on for exactly that job's compute,
and the engine's row checks loose enough for it then. TF32 itself needs an Ampere or later GPU; on this CPU the
setting is TensorFlow's flag, which is what is tested here."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from contracts.jobspec import JobOptions
from tests import models
from tests.engine.conftest import rand
from worker.engine import build_problem, load_model
from worker.engine.agreement import rows_agree
from worker.engine.devices import prepare_gpus, tensor_float_32


def tf32_enabled() -> bool:
    import tensorflow as tf

    return bool(tf.config.experimental.tensor_float_32_execution_enabled())


def test_precision_defaults_to_highest_and_refuses_anything_else():
    assert JobOptions().precision == "highest" and JobOptions(precision="tf32").precision == "tf32"
    with pytest.raises(ValidationError, match="precision"):
        JobOptions(precision="fp16")


def test_the_context_sets_tf32_and_restores_it_even_on_errors():
    prepare_gpus()  # as load_model and run_problem do: TF32 off
    assert not tf32_enabled()
    with tensor_float_32(True):
        assert tf32_enabled()
    assert not tf32_enabled()
    with pytest.raises(RuntimeError), tensor_float_32(True):
        raise RuntimeError("a failing job")
    assert not tf32_enabled()


@pytest.mark.parametrize("precision,during", [("highest", False), ("tf32", True)])
def test_compute_to_storage_runs_the_job_under_its_precision(tmp_path, precision, during):
    from worker.pipeline import compute_to_storage

    model = load_model(str(models.mlp(tmp_path / "mlp")))
    problem = build_problem(model, {"x": rand((2, 8))})
    seen = []
    compute_to_storage(problem, results_url=str(tmp_path / "results"), job_id="p", precision=precision,
                       on_plan=lambda plan: seen.append(tf32_enabled()))
    assert seen and set(seen) == {during}
    assert not tf32_enabled()  # restored after the job


def test_row_checks_allow_tf32_rounding_only_when_it_is_on():
    prepare_gpus()
    want = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
    got = want * (1 + 5e-3)  # what 10 bits of mantissa do to a matmul's inputs
    assert not rows_agree(got, want)
    with tensor_float_32(True):
        assert rows_agree(got, want)
        assert not rows_agree(want + 0.5, want)
