"""Packaging and operations files: compose, Dockerfile, CI entry point, scripts, README."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["scripts/setup.sh", "scripts/test.sh", "scripts/up.sh", "scripts/uv.sh", ".ci/run"]


# --- docker-compose.yml ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    yaml = pytest.importorskip(
        "yaml", reason="PyYAML missing: docker-compose.yml NOT CHECKED; install the test extra (pyyaml)")
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict), "docker-compose.yml: no services"
    return doc


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _healthcheck_test(service: dict) -> list[str]:
    test = service.get("healthcheck", {}).get("test")
    assert test, "no healthcheck.test"
    return [test] if isinstance(test, str) else list(test)


def test_compose_has_the_services_with_healthchecks(compose):
    services = compose["services"]
    for name in ("redis", "minio", "createbucket", "api", "worker", "prometheus"):
        assert name in services, f"docker-compose.yml: service {name!r} missing"
    for name in ("redis", "minio", "api", "worker"):
        test = _healthcheck_test(services[name])
        assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck.test must start with CMD or CMD-SHELL"


def test_compose_redis_keeps_an_append_only_file(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    command = command.split() if isinstance(command, str) else command
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
    assert any(str(v).endswith(":/data") for v in redis.get("volumes", [])), "redis: /data is not a volume"
    assert "redis-cli" in _healthcheck_test(redis)


def test_compose_worker_reserves_a_gpu_and_scales(compose):
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and d.get("count") == 1
               for d in devices), f"worker: no nvidia GPU reservation in {devices}"
    assert "container_name" not in worker, "worker: container_name prevents --scale"
    assert not worker.get("ports"), "worker: host ports prevent --scale"


def test_compose_builds_the_two_targets_with_shared_config(compose):
    services = compose["services"]
    for name in ("api", "worker"):
        svc = services[name]
        assert svc["build"]["target"] == name
        env = _env(svc)
        assert env["JACOBIAN_REDIS_URL"] == "redis://redis:6379/0"
        assert env["JACOBIAN_RESULTS_URL"].startswith("s3://jacobian/")
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert env["JACOBIAN_MODEL_ROOTS"] == "/models"
        assert any(str(v).endswith(":/models:ro") for v in svc["volumes"]), f"{name}: ./models not read-only"
        deps = svc["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["createbucket"]["condition"] == "service_completed_successfully"
    assert "8000:8000" in [str(p) for p in services["api"]["ports"]]
    assert "jacobian" in " ".join(services["createbucket"]["command"]), "createbucket must create the bucket"


def test_compose_sets_only_known_settings(compose):
    from contracts.settings import Settings

    known = {f"JACOBIAN_{name.upper()}" for name in Settings.model_fields}
    for name, svc in compose["services"].items():
        unknown = sorted(k for k in _env(svc) if k.startswith("JACOBIAN_") and k not in known)
        assert not unknown, f"{name}: {unknown} are not fields of contracts.settings.Settings"


def test_prometheus_config_scrapes_api_and_workers(compose):
    import yaml

    mounts = compose["services"]["prometheus"]["volumes"]
    assert any(str(v).startswith("./docs/prometheus.yml:") for v in mounts)
    config = yaml.safe_load((REPO / "docs" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    api_targets = [t for sc in jobs["jacobian-api"]["static_configs"] for t in sc["targets"]]
    assert api_targets == ["api:8000"]
    worker_sd = jobs["jacobian-worker"]["dns_sd_configs"][0]
    assert worker_sd["names"] == ["worker"] and worker_sd["port"] == 9100


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: bash scripts/setup.sh --with-prometheus to check docs/prometheus.yml")
    result = subprocess.run([promtool, "check", "config", str(REPO / "docs" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Dockerfile -----------------------------------------------------------------------------------

def _stages() -> dict[str, dict]:
    """Stage name -> {"parent": FROM image or stage, "lines": [instructions with continuations joined]}."""
    text = (REPO / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    stages: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", line, re.IGNORECASE)
        if m:
            current = {"parent": m.group(1), "lines": []}
            stages[m.group(2) or f"stage{len(stages)}"] = current
        elif current is not None:
            current["lines"].append(line)
    return stages


def _chain(stages: dict[str, dict], name: str) -> list[str]:
    """Every instruction that shapes stage ``name``: its ancestors' and the stages it copies from."""
    out: list[str] = []
    stage = stages[name]
    if stage["parent"] in stages:
        out += _chain(stages, stage["parent"])
    for line in stage["lines"]:
        m = re.match(r"COPY\s+.*--from=(\S+)", line, re.IGNORECASE)
        if m and m.group(1) in stages:
            out += _chain(stages, m.group(1))
        out.append(line)
    return out


def _last(lines: list[str], instruction: str) -> str | None:
    found = [line for line in lines if line.split(None, 1)[0].upper() == instruction]
    return found[-1].split(None, 1)[1] if found else None


def test_dockerfile_has_api_and_worker_targets_run_as_non_root():
    stages = _stages()
    assert {"api", "worker"} <= set(stages), f"Dockerfile targets: {sorted(stages)}"
    base = next(iter(stages.values()))
    assert base["parent"].startswith(("python:3.11", "${PYTHON_IMAGE}"))
    assert "python:3.11-slim" in (REPO / "Dockerfile").read_text()
    for name in ("api", "worker"):
        user = _last(_chain(stages, name), "USER")
        assert user and user.split(":")[0] not in ("root", "0"), f"{name}: runs as {user or 'root'}"


def test_dockerfile_cmds_are_exec_form():
    stages = _stages()
    expected = {"api": ["jacobian", "serve", "--host", "0.0.0.0", "--port", "8000"],
                "worker": ["jacobian", "worker", "--supervise"]}
    for name, cmd in expected.items():
        raw = _last(stages[name]["lines"], "CMD")
        assert raw is not None, f"{name}: no CMD"
        assert json.loads(raw) == cmd, f"{name}: CMD {raw} is not the exec form {cmd}"
    health = _last(stages["api"]["lines"], "HEALTHCHECK")
    assert health and "/healthz" in health and "CMD [" in health, "api: HEALTHCHECK on /healthz missing"


def test_dockerfile_keeps_tensorflow_out_of_the_api_image():
    stages = _stages()
    api = " ".join(_chain(stages, "api"))
    assert "tensorflow" not in api.lower() and "[worker]" not in api, "the api image must not install TensorFlow"
    assert "--extra api" in api and "--extra worker" not in api and "--extra cuda" not in api
    worker = " ".join(_chain(stages, "worker"))
    assert "--extra worker" in worker and "--extra cuda" in worker and "--extra api" not in worker
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "tensorflow[and-cuda]==2.21.*" in extras["cuda"], "the worker image needs TensorFlow with its CUDA wheels"


def _uv_version() -> str:
    text = (REPO / "scripts/uv.sh").read_text()
    m = re.search(r'^VERSION="\$\{JACOBIAN_UV_VERSION:-([0-9.]+)\}"$', text, re.MULTILINE)
    assert m, "scripts/uv.sh: no pinned VERSION"
    return m.group(1)


def test_dockerfile_installs_from_the_lock_with_the_pinned_uv():
    stages = _stages()
    for name in ("api", "worker"):
        lines = _chain(stages, name)
        syncs = [line for line in lines if line.startswith("RUN") and "uv sync" in line]
        assert syncs and all("--locked" in line and "--no-editable" in line for line in syncs), \
            f"{name}: install with `uv sync --locked --no-editable`: {syncs}"
        assert not any(re.search(r"\bpip install\b(?! uv==)", line) for line in lines), \
            f"{name}: pip install besides uv itself bypasses uv.lock"
        copied = " ".join(line for line in lines if line.startswith("COPY") and "--from" not in line)
        assert "uv.lock" in copied and "pyproject.toml" in copied
        assert f"pip install uv=={_uv_version()}" in " ".join(lines), f"{name}: not the uv of scripts/uv.sh"
    assert re.search(rf'required-version = ">={re.escape(_uv_version())}"', (REPO / "pyproject.toml").read_text())


def test_dockerfile_copies_only_files_that_exist_and_reach_the_build_context():
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    sources = []
    for stage in _stages().values():
        for line in stage["lines"]:
            words = line.split()
            if words[0].upper() == "COPY" and not any(w.startswith("--from") for w in words):
                sources += [w for w in words[1:-1] if not w.startswith("--")]
    assert "uv.lock" in sources
    for source in sources:
        assert (REPO / source).exists(), f"Dockerfile: COPY {source}: no such file in the repository"
        assert source not in ignored, f"Dockerfile: COPY {source}, but .dockerignore leaves it out of the context"


def test_dockerfile_copies_every_package_of_the_project():
    """Each top-level package that pyproject.toml installs (``jacobian`` holds the console script) reaches the
    images: a package left out of the build stage's COPY would install a ``jacobian`` command that cannot start."""
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(pattern.rstrip("*") for pattern in include)
    assert "jacobian" in packages and "app" in packages, f"pyproject.toml packages.find include: {include}"
    copied = {line.split()[1].rstrip("/") for line in _chain(_stages(), "build")
              if line.split()[0].upper() == "COPY" and "--from" not in line}
    missing = [name for name in packages if name not in copied]
    assert not missing, f"Dockerfile build stage: add COPY {' '.join(missing)} ./<name> (pyproject.toml installs them)"


def test_dockerignore_keeps_local_state_out():
    entries = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", "var", ".git"} <= entries


# --- scripts and CI -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SCRIPTS)
def test_scripts_are_strict_executable_bash(path):
    file = REPO / path
    text = file.read_text()
    assert text.startswith("#!/usr/bin/env bash\n"), f"{path}: shebang must be #!/usr/bin/env bash"
    assert re.search(r"^set -euo pipefail$", text, re.MULTILINE), f"{path}: missing 'set -euo pipefail'"
    assert os.access(file, os.X_OK), f"{path}: not executable (chmod +x {path})"
    bash = shutil.which("bash")
    if bash:
        result = subprocess.run([bash, "-n", str(file)], capture_output=True, text=True)
        assert result.returncode == 0, f"{path}: bash -n: {result.stderr}"


def test_ci_runs_the_one_test_command():
    lines = [line for line in (REPO / ".ci/run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines[-1] == "exec bash scripts/test.sh"
    test_sh = (REPO / "scripts/test.sh").read_text()
    assert "bash scripts/setup.sh" in test_sh and "-m pytest" in test_sh
    assert "bash scripts/uv.sh lock --check" in test_sh, "CI must fail on a uv.lock out of date with pyproject.toml"
    assert test_sh.index("uv.sh lock --check") < test_sh.index("bash scripts/setup.sh")
    setup_sh = (REPO / "scripts/setup.sh").read_text()
    assert "sync --locked" in setup_sh and "pip install" not in setup_sh, "setup.sh installs from uv.lock"
    assert "exec .venv/bin/jacobian up" in (REPO / "scripts/up.sh").read_text()


def _run_test_sh(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "JACOBIAN_SKIP_SETUP": "1"}
    return subprocess.run(["bash", str(REPO / "scripts/test.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def needs_venv():
    if not (REPO / ".venv/bin/python").exists():
        pytest.skip("scripts/test.sh runs .venv/bin/python: run scripts/setup.sh first")


def test_test_sh_fails_when_no_test_is_collected(tmp_path, needs_venv):
    result = _run_test_sh([str(tmp_path)])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "collected no tests" in result.stderr
    assert result.stdout.rstrip().splitlines()[-1] == "summary: 0 passed, 0 failed, 0 skipped"


def test_test_sh_passes_codes_through_and_summarises(tmp_path, needs_venv):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 0\n"
        "@pytest.mark.skip(reason='sample')\ndef test_skipped():\n    pass\n")
    failing = _run_test_sh([str(tmp_path)])
    assert failing.returncode == 1
    assert failing.stdout.rstrip().splitlines()[-1] == "summary: 1 passed, 1 failed, 1 skipped"
    passing = _run_test_sh([f"{tmp_path / 'test_sample.py'}::test_ok"])
    assert passing.returncode == 0, passing.stdout + passing.stderr
    assert passing.stdout.rstrip().splitlines()[-1] == "summary: 1 passed, 0 failed, 0 skipped"


# --- README ---------------------------------------------------------------------------------------

def test_readme_quickstart_names_the_two_commands():
    readme = (REPO / "README.md").read_text()
    m = re.search(r"^## Quickstart\n(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    assert m, "README.md: no '## Quickstart' section"
    commands = re.findall(r"^bash (scripts/\S+)", m.group(1), re.MULTILINE)
    assert commands == ["scripts/up.sh", "scripts/test.sh"], commands


def test_readme_documents_every_setting():
    from contracts.settings import Settings

    readme = (REPO / "README.md").read_text()
    missing = [f"JACOBIAN_{name.upper()}" for name in Settings.model_fields
               if f"`JACOBIAN_{name.upper()}`" not in readme]
    assert not missing, f"README.md configuration table lacks {missing}"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL"):
        assert name in readme
