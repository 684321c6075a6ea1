"""The CLI prints the rules' messages in its own spelling (issue 30): flags for fields, ``--reduce sum`` for
``reduce='sum'``, no ``GET /v1/models/signature`` to a command-line user, the fixes of ``NotConverged`` as flags;
``jacobian submit`` as well as ``jacobian compute``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from contracts.rules import RuleViolation, check_hessian, resolve_wrt
from jacobian.cli_words import as_flag


@dataclass
class T:
    dtype: str
    shape: tuple[int, ...]


def refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(RuleViolation) as caught:
        fn(*args, **kwargs)
    return str(caught.value)


def test_an_integer_wrt_points_cli_users_at_flags_not_the_http_api():
    api = refusal(resolve_wrt, "ids", {"ids": T("int32", (3,)), "x": T("float32", (3,))}, {}, signature="sig")
    assert "GET /v1/models/signature" in api                       # the API's own spelling stays as it is
    cli = as_flag(api)
    assert cli.startswith("--wrt: ") and "GET /v1" not in cli and "'x'" in cli
    assert "--wrt variables/<name> with a name the model does not have lists them all" in cli


def test_the_non_scalar_hessian_message_says_reduce_sum_as_a_flag():
    api = refusal(check_hessian, "y", (2, 3), None)
    assert "reduce='sum'" in api
    cli = as_flag(api)
    assert cli.startswith("--of: ") and "--reduce sum" in cli and "reduce='sum'" not in cli


def test_not_converged_fixes_as_flags():
    message = ("svd: not converged within 2 iterations (...): relative residuals [0.1] of the 4 singular values "
               "against tol 1e-08; raise max_iterations (now 2), loosen tol (now 1e-08; these residuals meet 0.2) "
               "or ask for a smaller rank (now 4); or set allow_unconverged: true to keep this result")
    cli = as_flag(message)
    for flag in ("--max-iterations (now 2)", "--tol (now 1e-08", "--rank (now 4)", "--allow-unconverged"):
        assert flag in cli
    assert "allow_unconverged" not in cli and "max_iterations" not in cli


def test_submit_prints_the_apis_errors_in_cli_spelling(capsys):
    from jacobian.cli_client import _fail

    assert _fail("InvalidRequest", "of: ... set reduce='sum' for the Hessian of sum(y)", code=1) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: InvalidRequest: --of: ") and "--reduce sum" in err


def test_the_jvp_refusals_fixes_are_flags():
    """The fixes ``worker.engine.jvp_rows.refusal`` names, as the CLI prints them."""
    budget = as_flag("memory_budget_bytes: TensorFlow cannot compute jvp of 'y' (...). Forward mode and second "
                     "derivatives fail here, and J v from VJPs keeps J (480 bytes); set memory_budget_bytes to at "
                     "least 480, or ask for a smaller of or wrt")
    assert budget.startswith("--memory-budget: ") and "pass --memory-budget of at least 480" in budget
    assert "a smaller --of or --wrt" in budget and "memory_budget_bytes" not in budget
    mode = as_flag("mode: TensorFlow cannot compute jvp (...). Forward mode fails here; use mode 'auto' or 'reverse' "
                   "(J v from VJPs)")
    assert mode.startswith("--mode: ") and "use --mode auto or --mode reverse" in mode
