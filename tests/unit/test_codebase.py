"""The codebase's own rules: ruff clean with the configuration in pyproject.toml, and small modules."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 420  # "about 400": past that, a module has taken on a second job


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    assert found, "ruff is not installed: it comes with the test extra (bash scripts/setup.sh)"
    return [found]


def test_ruff_is_clean():
    done = subprocess.run([*_ruff(), "check", "--output-format", "concise", str(REPO)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_of_the_service_is_over_about_400_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for package in ("jacobian", "app", "worker", "contracts") for p in (REPO / package).rglob("*.py")}
    assert sizes, "no modules found"
    too_long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"split these modules by job: {too_long}"


# -- the kind registry: kind names compared only there and in the executors -----------------------------------

KIND_SCOPE = ("app", "worker", "contracts", "jacobian")
KIND_ALLOWED = ("contracts/kinds.py", "worker/execution/")


def _kind_names() -> frozenset[str]:
    sys.path.insert(0, str(REPO))
    from contracts.kinds import KINDS

    return frozenset(KINDS)


def _names_a_kind(node: ast.AST, kinds: frozenset[str]) -> str | None:
    """The kind ``node`` spells: a string literal, ``Kind.<name>`` (or its ``.value``), or one of those inside a
    tuple, list or set literal (``kind in ("jvp", "vjp")``); None for anything else."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((found for e in node.elts if (found := _names_a_kind(e, kinds))), None)
    if isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in kinds:
        return repr(node.value)
    if isinstance(node, ast.Attribute) and node.attr in kinds:
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "Kind") or (
                isinstance(owner, ast.Attribute) and owner.attr == "Kind"):
            return f"Kind.{node.attr}"
    return None


def kind_comparisons(source: str, kinds: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, code)`` of each comparison (``==``, ``!=``, ``in``, ``not in``, ``is``; a ``match`` case) of
    something with a kind name in ``source``. A kind name as a dict key, an argument or a default is none."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            if any(_names_a_kind(side, kinds) for side in (node.left, *node.comparators)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and _names_a_kind(node.value, kinds):
            found.append((node.lineno, f"case {ast.unparse(node.value)}"))
    return sorted(found)


def test_the_kind_comparison_finder_finds_them():
    kinds = frozenset({"jacobian", "svd", "jvp", "vjp", "hessian"})
    compared = ('kind == "svd"\nif k in ("jvp", "vjp"): pass\nx = a if options.kind != Kind.hessian else b\n'
                'ok = "jacobian" not in kinds\ny = jobspec.Kind.svd.value == kind\n'
                'match kind:\n    case "jvp":\n        pass\n')
    assert [line for line, _ in kind_comparisons(compared, kinds)] == [1, 2, 3, 4, 5, 7]
    asked = ('F = {"svd": f, "jvp": g}\ndef run(kind="jacobian"): return F["svd"]\nop.apply("vjp", s)\n'
             'if spec.seeds == "of" and kind in PRODUCT_KINDS: pass\nKind.jvp\n')
    assert kind_comparisons(asked, kinds) == []


def test_kind_names_are_compared_only_in_the_registry_and_the_executors():
    """Every other module asks ``contracts.kinds`` (``kind_spec(name).<attribute>``) instead of comparing names."""
    kinds = _kind_names()
    assert {"jacobian", "hessian", "jvp", "svd"} <= kinds
    offenders = []
    for package in KIND_SCOPE:
        for path in sorted((REPO / package).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if name.startswith(KIND_ALLOWED):
                continue
            offenders += [f"{name}:{line}: {code}" for line, code in kind_comparisons(path.read_text(), kinds)]
    assert not offenders, ("compare kind names only in contracts/kinds.py and worker/execution/; ask the registry "
                           "(contracts.kinds.kind_spec) instead:\n" + "\n".join(offenders))


# -- the job path: no function over 12 parameters -------------------------------------------------------------

MAX_PARAMETERS = 12
JOB_PATH = ("worker", "contracts", "app/submit.py", "app/checks.py")


def parameter_counts(source: str) -> list[tuple[int, str, int]]:
    """``(line, name, parameters)`` of every function and lambda in ``source``: positional and keyword-only
    parameters (a leading ``self`` or ``cls`` aside), ``*args`` and ``**kwargs`` one each."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = node.args
        names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        if names and names[0] in ("self", "cls") and (a.posonlyargs or a.args):
            names = names[1:]
        count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
        out.append((node.lineno, getattr(node, "name", "<lambda>"), count))
    return out


def test_the_parameter_count_counts_every_kind_of_parameter():
    counts = parameter_counts("class C:\n    def m(self, a, /, b, *args, c, d=1, **kw): pass\n"
                              "def f(x, y=2): pass\ng = lambda *a: a\n")
    assert sorted(counts) == [(2, "m", 6), (3, "f", 2), (4, "<lambda>", 1)]


def test_no_function_in_the_job_path_takes_more_than_12_parameters():
    """Past a dozen parameters a function wants its options grouped (a small frozen dataclass)."""
    paths = []
    for entry in JOB_PATH:
        target = REPO / entry
        paths += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert len(paths) > 20
    too_many = [f"{p.relative_to(REPO).as_posix()}:{line}: {name} takes {n}"
                for p in paths for line, name, n in parameter_counts(p.read_text()) if n > MAX_PARAMETERS]
    assert not too_many, f"group these parameters (at most {MAX_PARAMETERS}):\n" + "\n".join(too_many)


def test_test_modules_have_unique_basenames():
    """pytest (rootdir-relative imports, no __init__.py) refuses to collect two test modules of one name."""
    seen: dict[str, str] = {}
    twice = []
    for p in sorted((REPO / "tests").rglob("test_*.py")):
        if p.name in seen:
            twice.append((seen[p.name], str(p.relative_to(REPO))))
        seen.setdefault(p.name, str(p.relative_to(REPO)))
    assert not twice, f"rename one of each pair: {twice}"


OUR_PACKAGES = ("app", "worker", "contracts", "jacobian")


def private_imports(source: str) -> list[str]:
    """``from <our module> import _name`` (a private name taken across modules) in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OUR_PACKAGES:
            out += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and
                    not a.name.startswith("__")]
    return out


def test_the_private_import_finder_finds_them():
    assert private_imports("from worker.engine.problem import _ruled, ruled\nfrom os import _exit\n") == \
        ["worker.engine.problem._ruled"]


def test_no_private_helper_is_imported_across_modules():
    """Helpers shared across modules are public (issue 24): nothing imports another module's ``_name``."""
    found = {str(p.relative_to(REPO)): names for package in OUR_PACKAGES for p in sorted((REPO / package).rglob("*.py"))
             if (names := private_imports(p.read_text()))}
    assert not found, f"make these public or move them: {found}"
