"""``jacobian submit`` for the matrix-free kinds against a fake API: ``--seeds`` travels as the member
``__seeds__`` of the .npz body, ``--rank``/``--tol``/``--samples`` and comma-separated ``--wrt`` as query
parameters."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest

from jacobian import cli, cli_client
from jacobian.client import JacobianClient

JOB = "d" * 32


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(202, json={"id": JOB, "status": "queued"})

    monkeypatch.setattr(cli_client, "_client",
                        lambda args: JacobianClient("http://api", transport=httpx.MockTransport(handler)))
    return requests


def test_submit_sends_seeds_in_the_npz_and_the_options_as_query(seen, tmp_path, capsys):
    x = np.ones((3, 5))
    seeds = np.arange(2 * 12, dtype=np.float64).reshape(2, 3, 4)
    np.savez(tmp_path / "in.npz", x=x)
    np.save(tmp_path / "seeds.npy", seeds)
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--of", "y", "--wrt",
                     "x,variables/w", "--kind", "vjp", "--seeds", str(tmp_path / "seeds.npy")])
    assert code == 0 and capsys.readouterr().out == f"{JOB}\n"
    request = seen[0]
    assert request.url.params["kind"] == "vjp" and request.url.params["wrt"] == "x,variables/w"
    with np.load(io.BytesIO(request.content)) as npz:
        np.testing.assert_array_equal(npz["__seeds__"], seeds)
        np.testing.assert_array_equal(npz["x"], x)
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--of", "y", "--kind",
                     "svd", "--rank", "3", "--tol", "1e-6"])
    assert code == 0
    assert (seen[1].url.params["rank"], seen[1].url.params["tol"]) == ("3", "1e-06")
    assert "__seeds__" not in np.load(io.BytesIO(seen[1].content)).files
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--of", "loss", "--kind",
                     "logdet", "--probes", "20", "--steps", "30", "--damping", "0.5"])
    assert code == 0
    params = seen[2].url.params
    assert (params["probes"], params["steps"], params["damping"]) == ("20", "30", "0.5") and "sigma" not in params


def test_unreadable_seeds_are_refused_naming_the_option(seen, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", x=np.ones((3, 5)))
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--kind", "jvp",
                     "--seeds", str(tmp_path / "missing.npy")])
    assert code == 2 and "--seeds:" in capsys.readouterr().err and not seen


def test_submit_sends_the_curvature_fields_as_query(seen, tmp_path, capsys):
    """``--loss``, ``--labels``, ``--damping``, ``--curvature``, ``--max-iterations``: the request fields of the same
    names; the labels travel as their member of the --input .npz."""
    np.savez(tmp_path / "in.npz", x=np.ones((3, 5)), t=np.zeros((3, 4)))
    np.save(tmp_path / "seeds.npy", np.ones((2, 3, 5)))
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--of", "y", "--kind", "ihvp",
                     "--curvature", "ggn", "--loss", "mse", "--damping", "0.5", "--max-iterations", "40",
                     "--seeds", str(tmp_path / "seeds.npy")])
    assert code == 0 and capsys.readouterr().out == f"{JOB}\n"
    params = seen[0].url.params
    assert (params["kind"], params["curvature"], params["loss"], params["damping"], params["max_iterations"]) == \
        ("ihvp", "ggn", "mse", "0.5", "40")
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--of", "y", "--kind",
                     "fisher_vp", "--loss", "softmax_cross_entropy", "--labels", "t",
                     "--seeds", str(tmp_path / "seeds.npy")])
    assert code == 0 and seen[1].url.params["labels"] == "t" and "damping" not in seen[1].url.params
    assert set(np.load(io.BytesIO(seen[1].content)).files) == {"x", "t", "__seeds__"}
