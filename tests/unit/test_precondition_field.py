"""The ``precondition`` field of ``ihvp`` (issue 27) through the contracts: accepted for ``ihvp`` only, its values
checked at the request, the preconditioner's diagonal products in the quote, and the CLI flag of the same name."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from contracts.estimators import DIAGONAL_PROBES
from contracts.jobspec import SEEDS_MEMBER, JobOptions, ModelRef, QueuedJob
from contracts.quote import quote
from contracts.savedmodel import Signature, TensorSpec
from jacobian import cli, cli_client
from jacobian.client import JacobianClient

SIG = Signature("serving_default", inputs={"x": TensorSpec("x", "float32", (None, 8))},
                outputs={"loss": TensorSpec("loss", "float32", ())})


def job(**options) -> QueuedJob:
    return QueuedJob(id="", model=ModelRef(path="/nowhere"), inputs_uri="", results_url="", **options)


def test_precondition_is_an_ihvp_field_with_two_values():
    assert JobOptions(of="loss", kind="ihvp", damping=0.1, precondition="diagonal").precondition == "diagonal"
    assert JobOptions(of="loss", kind="ihvp", damping=0.1).precondition is None
    with pytest.raises(ValidationError, match="precondition: only for kind 'ihvp'"):
        JobOptions(of="loss", kind="hessian_diag", precondition="diagonal")
    with pytest.raises(ValidationError, match="precondition"):
        JobOptions(of="loss", kind="ihvp", damping=0.1, precondition="jacobi")


@pytest.mark.parametrize("rows,diagonal", [(16, DIAGONAL_PROBES), (4, 32)])   # n = 128: Hutchinson; 32: exact
def test_the_quote_counts_the_preconditioners_diagonal(rows, diagonal):
    shapes = {"x": ((rows, 8), "float32"), SEEDS_MEMBER: ((2, rows, 8), "float32")}
    plain = quote(job(of="loss", wrt="x", kind="ihvp", damping=0.1), SIG, {}, shapes)
    pcg = quote(job(of="loss", wrt="x", kind="ihvp", damping=0.1, precondition="diagonal"), SIG, {}, shapes)
    assert pcg.passes.count == plain.passes.count + diagonal and "preconditioner" in pcg.passes.note


def test_the_cli_flag_sends_the_field(monkeypatch, tmp_path, capsys):
    import numpy as np

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202, json={"id": "d" * 32, "status": "queued"})

    monkeypatch.setattr(cli_client, "_client",
                        lambda args: JacobianClient("http://api", transport=httpx.MockTransport(handler)))
    np.savez(tmp_path / "in.npz", x=np.ones((3, 5)))
    np.save(tmp_path / "seeds.npy", np.ones((2, 3, 5)))
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--of", "loss", "--kind",
                     "ihvp", "--damping", "0.5", "--precondition", "diagonal", "--seeds", str(tmp_path / "seeds.npy")])
    assert code == 0 and seen[0].url.params["precondition"] == "diagonal"
    code = cli.main(["submit", "--model", "f64", "--input", str(tmp_path / "in.npz"), "--of", "loss", "--kind",
                     "ihvp", "--damping", "0.5", "--seeds", str(tmp_path / "seeds.npy")])
    assert code == 0 and "precondition" not in seen[1].url.params
