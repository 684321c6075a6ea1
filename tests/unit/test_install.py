"""Installs: the client-only install (``pip install jacobian-service``) imports and runs without TensorFlow
or the server stack; the dependency metadata and uv.lock agree with that; every dependency is bounded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT = "jacobian-service"

# Distributions a client-only install must not pull (TensorFlow, the API's and the workers' stack) ...
SERVER_DISTS = {"tensorflow", "tensorflow-cpu", "keras", "jax", "fastapi", "starlette", "uvicorn", "redis", "rq",
                "prometheus-client", "s3fs", "boto3", "botocore", "aiobotocore", "matplotlib", "nvidia-ml-py"}
# ... and the modules the client and the CLI's client commands must not import, even lazily.
SERVER_MODULES = {"tensorflow", "keras", "jax", "fastapi", "starlette", "uvicorn", "redis", "rq", "prometheus_client",
                  "s3fs", "boto3", "botocore", "aiobotocore", "matplotlib", "pynvml"}
# ... nor the service's own server-side packages: the HTTP API and the worker (whose code needs the extras).
SERVICE_PACKAGES = {"app", "worker"}
CLIENT_BLOCKED = ",".join(sorted(SERVER_MODULES | SERVICE_PACKAGES))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return _norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _lock() -> dict:
    return tomllib.loads((REPO / "uv.lock").read_text())


def _locked_closure(lock: dict, extras: tuple[str, ...] = ()) -> set[str]:
    """Every package the lock installs for the project with ``extras``, on any platform (markers ignored)."""
    packages = {_norm(p["name"]): p for p in lock["package"]}
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    todo = [(PROJECT, extra) for extra in ("", *extras)]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        names.add(name)
        package = packages[name]
        deps = package.get("dependencies", []) if not extra else package.get("optional-dependencies", {}).get(extra, [])
        for dep in deps:
            dep_name = _norm(dep["name"])
            todo += [(dep_name, "")] + [(dep_name, e) for e in dep.get("extra", [])]
    return names - {PROJECT}


# --- metadata -------------------------------------------------------------------------------------


def test_base_dependencies_are_the_client_only():
    base = {_name(r) for r in _pyproject()["dependencies"]}
    assert not base & SERVER_DISTS, f"the base dependencies (the client install) pull {sorted(base & SERVER_DISTS)}: " \
        "move them to the api or worker extra of pyproject.toml"
    assert {"httpx", "numpy", "pydantic", "pydantic-settings", "zarr", "tqdm"} <= base


def test_the_locked_client_install_has_no_server_package():
    """The whole locked closure of the base dependencies, transitive ones and every platform's included."""
    closure = _locked_closure(_lock())
    assert closure, "uv.lock: no package for the project's base dependencies"
    assert not closure & SERVER_DISTS, f"a client-only install would pull {sorted(closure & SERVER_DISTS)}"


def test_the_api_install_has_no_tensorflow_and_the_worker_none_of_the_api():
    lock = _lock()
    api, worker = _locked_closure(lock, ("api",)), _locked_closure(lock, ("worker",))
    assert {"fastapi", "uvicorn", "redis", "rq", "prometheus-client", "matplotlib"} <= api
    assert not api & {"tensorflow", "keras", "jax"}, "the api extra (Docker target api) must not pull TensorFlow"
    assert {"tensorflow", "redis", "rq", "prometheus-client"} <= worker
    assert not worker & {"fastapi", "uvicorn", "starlette", "matplotlib"}, "the worker extra pulls the API's stack"
    assert {"nvidia-cudnn-cu12", "tensorflow"} <= _locked_closure(lock, ("cuda",))


def test_every_dependency_has_an_upper_bound():
    project = _pyproject()
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    unbounded = [r for r in requirements if _name(r) != PROJECT and "<" not in r and not re.search(r"==[^,]*\*", r)]
    assert not unbounded, f"give these an upper bound at the next untested major version: {unbounded}"


def test_the_lock_matches_pyproject():
    """What `uv lock --check` (scripts/test.sh) checks in full, cheaply: the lock was made from these requirements."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    def key(name: str, extras, specifier: str, extra: str | None) -> tuple:
        return _norm(name), tuple(sorted(extras)), SpecifierSet(specifier or ""), extra

    project = _pyproject()
    wanted = set()
    for extra, requirements in [(None, project["dependencies"]), *project["optional-dependencies"].items()]:
        for text in requirements:
            r = Requirement(text)
            wanted.add(key(r.name, r.extras, str(r.specifier), extra))
    root = next(p for p in _lock()["package"] if _norm(p["name"]) == PROJECT)
    locked = set()
    for r in root["metadata"]["requires-dist"]:
        extra = re.fullmatch(r"extra == '([^']+)'", r.get("marker", ""))
        locked.add(key(r["name"], r.get("extras", []), r.get("specifier", ""), extra.group(1) if extra else None))
    assert wanted == locked, ("uv.lock is out of date with pyproject.toml: run `bash scripts/uv.sh lock` and commit "
                              f"uv.lock (only in pyproject: {wanted - locked}; only in uv.lock: {locked - wanted})")
    lock_python = _lock()["requires-python"].replace(" ", "")
    assert lock_python == project["requires-python"].replace(" ", "")


def test_cli_extras_match_pyproject():
    """The modules `jacobian serve/worker/compute/up` check for come with the extra they name."""
    from jacobian.cli import EXTRAS

    lock = _lock()
    provides = {"prometheus_client": "prometheus-client"}
    for extra, modules in EXTRAS.items():
        closure = _locked_closure(lock, (extra,))
        assert {provides.get(m, m) for m in modules} <= closure, \
            f"jacobian.cli.EXTRAS[{extra!r}] names a module that extra does not install"


# --- imports --------------------------------------------------------------------------------------

CLIENT_ONLY = textwrap.dedent("""
    import contextlib, importlib.abc, io, json, os, sys

    BLOCKED = set(sys.argv[1].split(","))
    attempts = []

    class Block(importlib.abc.MetaPathFinder):
        # A client-only install: importing any of BLOCKED fails, as it would where it is not installed.
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                attempts.append(name)
                raise ImportError(f"{name}: blocked, not part of a client-only install")
            return None

    sys.meta_path.insert(0, Block())

    import httpx
    import numpy as np
    import zarr

    import jacobian
    import jacobian.cli_client
    import jacobian.client
    from jacobian.cli import main

    assert jacobian.Client is jacobian.client.JacobianClient  # `from jacobian import Client`, loaded on first use

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code
        return code, out.getvalue(), err.getvalue()

    for argv in (["--help"], *([c, "--help"] for c in ("submit", "status", "fetch", "list", "cancel", "compute"))):
        code, out, err = run(*argv)
        assert code == 0 and out.startswith("usage: jacobian"), (argv, code, out, err)

    # The client commands against a fake API (httpx's MockTransport).
    tmp = sys.argv[2]
    job = "a" * 32
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    zarr.open_array(os.path.join(tmp, "r.zarr"), mode="w", shape=rows.shape, dtype=rows.dtype)[:] = rows
    record = {"id": job, "status": "succeeded", "plan": {}, "error": None, "kind": "jacobian",
              "progress": {"rows_done": 4, "rows_total": 4, "fraction": 1.0, "rows_per_second": 8.0},
              "result": {"uri": os.path.join(tmp, "r.zarr"), "shape": [4, 2], "dtype": "float32"},
              "created_at": "2026-01-01T00:00:00.000Z", "started_at": None, "finished_at": None,
              "model": {"path": "/models/mlp", "signature": "serving_default"}}

    def api(request):
        path = request.url.path
        if path == "/v1/jobs" and request.method == "POST":
            return httpx.Response(202, json={"id": job, "status": "queued"})
        if path == "/v1/jobs":
            return httpx.Response(200, json={"jobs": [record], "next_page_token": None})
        if path == f"/v1/jobs/{job}/result":
            a, b = (int(x) for x in request.url.params["rows"].split(":"))
            buf = io.BytesIO()
            np.save(buf, rows[a:b])
            return httpx.Response(200, content=buf.getvalue())
        if path in (f"/v1/jobs/{job}", f"/v1/jobs/{job}/cancel"):
            return httpx.Response(200, json=record)
        return httpx.Response(404, json={"error": {"type": "NotFound", "message": path}})

    class FakeClient(httpx.Client):
        def __init__(self, *args, transport=None, **kwargs):
            super().__init__(*args, transport=httpx.MockTransport(api), **kwargs)

    httpx.Client = FakeClient
    np.savez(os.path.join(tmp, "x.npz"), x=np.ones((2, 8), np.float32))
    api_url = ["--api", "http://api"]
    checks = [
        (["submit", "--model", "mlp", "--input", os.path.join(tmp, "x.npz"), "--wait", "--poll", "0"], job),
        (["status", job], '"succeeded"'),
        (["list"], job),
        (["cancel", job], '"succeeded"'),
        (["fetch", job, "--rows", "1:3", "-o", os.path.join(tmp, "rows.npy")], ""),
    ]
    for argv, expected in checks:
        code, out, err = run(*argv, *api_url)
        assert code == 0 and expected in out, (argv, code, out, err)
    assert np.load(os.path.join(tmp, "rows.npy")).tolist() == rows[1:3].tolist()
    with jacobian.Client("http://api") as client:
        assert client.result(job)[:].tolist() == rows.tolist()  # the lazy zarr array, from local storage
    assert jacobian.open_zarr(os.path.join(tmp, "r.zarr"))[1:3].tolist() == rows[1:3].tolist()  # by URI, no API

    client_attempts = list(attempts)
    # The commands that need an extra say which one (they look for its modules, import none of them).
    code, out, err = run("compute", "--model", "m", "--input", "x.npz", "--out", tmp)
    assert code == 2 and "pip install 'jacobian-service[worker]'" in err and "tensorflow" in err, (code, err)
    code, out, err = run("serve")
    assert code == 2 and "pip install 'jacobian-service[api]'" in err, (code, err)

    loaded = sorted({m.partition(".")[0] for m in sys.modules} & BLOCKED)
    print(json.dumps({"attempts": client_attempts, "loaded": loaded}))
""")


def test_client_and_cli_client_commands_run_without_tensorflow_or_the_server_stack(tmp_path):
    """A fresh interpreter in which importing TensorFlow, FastAPI, uvicorn, Redis, rq, prometheus_client, s3fs,
    boto or matplotlib fails: the client, ``jacobian --help`` and every client command still work, and none of
    them even tries such an import (one added at module level, or inside a client command, fails here)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JACOBIAN_API_URL": "http://api"}
    done = subprocess.run([sys.executable, "-c", CLIENT_ONLY, CLIENT_BLOCKED, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout.strip().splitlines()[-1]
    assert report == '{"attempts": [], "loaded": []}', f"client-only code tried to import {report}"


@pytest.mark.parametrize("module", ["tensorflow", "fastapi", "redis", "worker", "app"])
def test_the_import_guard_catches_a_server_import(tmp_path, module):
    """The guard above is live: a server module imported by the client's code path is reported."""
    code = CLIENT_ONLY.replace("import jacobian.cli_client\n", f"import jacobian.cli_client\ntry:\n"
                               f"    import {module}\nexcept ImportError:\n    pass\n", 1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, CLIENT_BLOCKED, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f'"attempts": ["{module}"]' in done.stdout


# --- the `jacobian` command and `import jacobian` as a user runs them -------------------------------


def _imported(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``argv`` with ``PYTHONPROFILEIMPORTTIME``: its result and the top-level names of every module it
    imported (what ``-X importtime`` prints, so a console script's imports are seen too)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \| *([\w.]+)$", done.stderr, re.MULTILINE)
    assert names, f"{argv}: no import-time lines on stderr: {done.stderr[-2000:]}"
    return done, {name.partition(".")[0] for name in names}


def test_import_jacobian_loads_nothing_but_itself():
    """``import jacobian`` is cheap: the client (httpx, numpy) is imported when ``jacobian.Client`` is first used."""
    done, top = _imported([sys.executable, "-c", "import jacobian; assert jacobian.__all__"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "jacobian" in top
    assert not top & (SERVER_MODULES | SERVICE_PACKAGES | {"httpx", "numpy", "zarr", "pydantic"}), sorted(top)


@pytest.mark.parametrize("args", [["--help"], ["status", "--help"], ["submit", "--help"], ["compute", "--help"]])
def test_the_jacobian_command_help_imports_no_server_or_worker_code(args):
    """The console script itself (``jacobian``, else ``python -m jacobian.cli``): ``--help`` and a client
    command's help import neither TensorFlow, FastAPI, the server stack, ``app`` nor ``worker``."""
    from tests.procs import jacobian_exe

    done, top = _imported([*jacobian_exe(), *args])
    assert done.returncode == 0 and done.stdout.startswith("usage: jacobian"), done.stdout + done.stderr[-2000:]
    assert "jacobian" in top
    assert not top & (SERVER_MODULES | SERVICE_PACKAGES), f"jacobian {' '.join(args)} imported " \
        f"{sorted(top & (SERVER_MODULES | SERVICE_PACKAGES))}"


def test_jacobian_compute_imports_no_queue_or_server_packages(tmp_path):
    """``jacobian compute`` runs the engine in-process: it imports TensorFlow and ``worker``, but not the worker's
    queue (redis, rq: 0.07 s of a 2.7 s process on a small model) nor the API's stack. Fails if the compute path
    imports ``worker.main`` again."""
    import numpy as np

    from tests import models
    from tests.procs import jacobian_exe

    model = models.mlp(tmp_path / "mlp")
    np.savez(tmp_path / "inputs.npz", x=np.ones((2, 8), np.float32))
    done, top = _imported([*jacobian_exe(), "compute", "--model", str(model), "--input", str(tmp_path / "inputs.npz"),
                           "--out", str(tmp_path / "out"), "--job-id", "j"])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert {"tensorflow", "worker", "zarr"} <= top, sorted(top)
    queue_and_api = {"redis", "rq", "fastapi", "starlette", "uvicorn", "app", "s3fs", "boto3", "matplotlib"}
    assert not top & queue_and_api, f"jacobian compute imported {sorted(top & queue_and_api)}"


def test_jacobian_names_resolve_lazily_and_say_what_exists():
    import jacobian
    import jacobian.client
    import jacobian.results

    for name in jacobian.__all__:
        module = jacobian.results if name.startswith(("open_", "coo_", "s3_")) else jacobian.client
        expected = jacobian.client.JacobianClient if name == "Client" else getattr(module, name)
        assert getattr(jacobian, name) is expected, name
    assert set(jacobian.__all__) <= set(dir(jacobian))
    with pytest.raises(AttributeError, match="no attribute 'JacobianClinet'; the public names are Client, "):
        jacobian.JacobianClinet  # noqa: B018
