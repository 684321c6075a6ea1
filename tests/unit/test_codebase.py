"""The codebase's own rules: ruff clean with the configuration in pyproject.toml, and small modules."""

from __future__ import annotations

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
