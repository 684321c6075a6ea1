"""The kind registry's data agrees with itself and with the code that asks it (no TensorFlow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from contracts.kinds import KINDS, Family, kind_spec
from contracts.layout import array_dimension_names, dimension_names


def test_every_array_has_its_axes_and_each_family_its_own_data():
    for spec in KINDS.values():
        assert len(spec.dims) == len(spec.arrays), spec.name
        assert (spec.spectrum is not None) == (spec.family is Family.spectral), spec.name
        assert bool(spec.routes) == (spec.family is Family.products), spec.name
        if spec.family is Family.products:
            assert spec.dims_of("products") == ("seed", spec.product_axes), spec.name
            assert spec.seeds in ("of", "wrt") and set(spec.routes) <= {"forward", "reverse"}, spec.name
        if "rank" in spec.fields:
            assert spec.spectrum is not None and spec.spectrum.counted, spec.name


def test_the_whole_matrix_of_a_kind_is_the_dense_kind_of_the_same_derivative():
    assert [kind_spec(k).whole_matrix for k in ("jvp", "vjp", "svd", "jacobian", "batch_jacobian")] == ["jacobian"] * 5
    assert {kind_spec(k).whole_matrix for k in ("hvp", "hessian_eig", "hessian_trace", "hessian", "hessian_diag",
                                                "spectral_density", "logdet")} == {"hessian"}


@pytest.mark.parametrize(("kind", "array", "want"), [
    ("jacobian", "jacobian", ["of_0", "of_1", "wrt_0"]),
    ("batch_jacobian", "jacobian", ["batch", "of_1", "wrt_1"]),
    ("hessian", "jacobian", ["wrt_0", "wrt2_0"]),
    ("jvp", "products", ["seed", "of_0", "of_1"]),
    ("vjp", "products", ["seed", "wrt_0"]),
    ("svd", "U", ["k", "of_0", "of_1"]),
    ("svd", "S", ["k"]),
    ("hessian_eig", "eigenvectors", ["k", "wrt_0"]),
    ("hessian_trace", "stderr", []),
    ("hessian_diag", "stderr", ["wrt_0"]),
    ("spectral_density", "nodes", ["probe", "step"]),
    ("spectral_density", "density", ["grid"]),
    ("logdet", "logdet", []),
])
def test_dimension_names_spell_out_the_kinds_dims(kind, array, want):
    of_shape, wrt_shape = ((2, 3), (2, 4)) if kind == "batch_jacobian" else ((2, 3), (4,))
    assert array_dimension_names(kind, array, of_shape, wrt_shape) == want


def test_the_main_arrays_names_are_the_result_arrays_and_several_sources_are_one_axis():
    assert dimension_names("hessian", (), (2,)) == ["wrt_0", "wrt2_0"]
    assert dimension_names(None, (1,), (2,)) == ["of_0", "wrt_0"]   # no kind: a Jacobian
    assert array_dimension_names("hvp", "products", (), (7,), wrt_names=["wrt"]) == ["seed", "wrt"]


def test_the_matrix_free_jobs_name_every_array_of_their_kind():
    from worker.matfree_job import dimension_names as matfree_names

    op = SimpleNamespace(of_shape=(3,), axis=SimpleNamespace(shape=(2, 5), names=("x",)))
    assert matfree_names(op, "svd") == {"S": ["k"], "U": ["k", "of_0"], "V": ["k", "wrt_0", "wrt_1"]}
    several = SimpleNamespace(of_shape=(3,), axis=SimpleNamespace(shape=(10,), names=("x", "y")))
    assert matfree_names(several, "jvp") == {"products": ["seed", "of_0"]}
    assert matfree_names(several, "hvp") == {"products": ["seed", "wrt"]}


def test_every_spectral_kind_has_an_algorithm_in_the_engine():
    from worker.engine import spectra

    for name, spec in KINDS.items():
        if spec.spectrum is not None:
            assert spec.spectrum.algorithm in spectra.ALGORITHMS, name
    assert spectra.ALGORITHMS["subspace_iteration"] is spectra.svd


@pytest.mark.parametrize(("kind", "values"), [("svd", [30.0, 2.0, 0.5]), ("hessian_eig", [-3.0, 1.0]),
                                               ("hessian_trace", 4.25), ("hessian_diag", [0.5, -1.0, 2.0]),
                                               ("hessian_diag", list(range(10_000))), ("logdet", -3.5),
                                               ("spectral_density", [0.0, 0.2, 1.0, 0.2, 0.0])])
def test_each_spectral_kind_draws_with_its_own_words(kind, values):
    import numpy as np

    from app.spectrum import render_spectrum

    attrs = {"kind": kind, "of": "y", "wrt": ["x", "w"], "method": "m", "residuals": [1e-6] * np.size(values),
             "products": {"jvp": 3, "hvp": 0}, "grid_range": [-1.0, 2.0], "sigma": 0.1, "probes": 4, "steps": 9,
             "damping": 0.5 if kind == "logdet" else None}
    png = render_spectrum(np.asarray(values), attrs, job_id="j", stderr=0.1 if kind == "hessian_trace" else None)
    assert png.startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="no spectrum"):
        render_spectrum(np.asarray(values), {**attrs, "kind": "jvp"})
