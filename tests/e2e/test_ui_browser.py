"""``GET /ui`` in a real headless Chromium (Debian's ``chromium``; ``scripts/setup.sh --with-chromium``),
and ``GET /v1/jobs/{id}/preview.png``.

A job is submitted while no worker runs, so the page must first show it ``queued``; then a worker
starts and the page (polled with ``chromium --dump-dom``) must show the same job ``succeeded`` with
full progress. A screenshot of the job view with its heatmap is taken with ``--screenshot``.
With ``JACOBIAN_DOCS_IMAGES=1`` the screenshot is also copied to ``docs/ui-screenshot.png`` (the
preview images in docs/ come from ``scripts/preview_examples.py``).
"""

from __future__ import annotations

import html
import io
import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from jacobian.client import JacobianClient
from tests import models
from tests.e2e.stack import Api, Stack, print_logs

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 180.0
WINDOW = (1280, 900)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


def chromium_exe() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: run `bash scripts/setup.sh --with-chromium` "
                    "(apt-get install chromium); scripts/test.sh does this")
    return exe


class Browser:
    """One headless Chromium run per call, each with a fresh profile under ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.exe = chromium_exe()
        self.workdir = workdir
        self.runs = 0

    def _run(self, url: str, *extra: str, budget_ms: int) -> subprocess.CompletedProcess[bytes]:
        self.runs += 1
        profile = self.workdir / f"profile-{self.runs}"
        args = [self.exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                f"--virtual-time-budget={budget_ms}", *extra, url]
        try:
            return subprocess.run(args, capture_output=True, timeout=90, stdin=subprocess.DEVNULL)
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    def dom(self, url: str, budget_ms: int = 3000) -> str:
        done = self._run(url, "--dump-dom", budget_ms=budget_ms)
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
        return done.stdout.decode(errors="replace")

    def screenshot(self, url: str, path: Path, budget_ms: int = 5000) -> None:
        done = self._run(url, f"--screenshot={path}", budget_ms=budget_ms)
        assert done.returncode == 0 and path.is_file(), done.stderr.decode(errors="replace")[-3000:]


def job_row_status(dom: str, job_id: str) -> str | None:
    """``data-status`` of the job's row in the job table of the dumped DOM (None: not listed)."""
    m = re.search(r'<tr\b[^>]*\bdata-job-id="' + re.escape(job_id) + r'"[^>]*>', dom)
    if not m:
        return None
    status = re.search(r'\bdata-status="([a-z]+)"', m.group(0))
    return status.group(1) if status else None


def job_row(dom: str, job_id: str) -> str:
    m = re.search(r'<tr\b[^>]*\bdata-job-id="' + re.escape(job_id) + r'"[^>]*>.*?</tr>', dom, re.DOTALL)
    assert m, f"job {job_id} not in the page"
    return html.unescape(re.sub(r"<[^>]+>", " ", m.group(0)))


def decode_png(data: bytes) -> np.ndarray:
    """A PNG as ``(h, w, 3)`` uint8 RGB (Pillow)."""
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def models_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.mlp(root / "wide", sizes=(24, 32, 16))  # x (None, 24) -> y (None, 16)
    return root


@pytest.fixture(scope="module")
def stack(request, redis_server, models_root, tmp_path_factory):
    """The API only; the test starts the worker when it wants jobs to run."""
    s = Stack(redis_server.url, models_root, tmp_path_factory.mktemp("ui"))
    failed_before = request.session.testsfailed
    try:
        s.api("api-ui")
        yield s
    finally:
        s.stop()
        if request.session.testsfailed > failed_before:
            print_logs(request, s.procs())


def test_ui_shows_a_job_progress_to_succeeded(stack: Stack, tmp_path: Path) -> None:
    api: Api = stack.apis[0]
    browser = Browser(tmp_path)
    x = np.random.default_rng(5).normal(size=(3, 24)).astype(np.float32)
    with JacobianClient(api.url) as client:
        job_id = client.submit("wide", {"x": x}, of="y", wrt="x", kind="jacobian")
        assert client.status(job_id)["status"] == "queued"

        r = httpx.get(f"{api.url}/v1/jobs/{job_id}/preview.png")
        assert r.status_code == 409 and r.json()["error"]["type"] == "JobNotFinished", r.text

        page = httpx.get(f"{api.url}/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert httpx.get(f"{api.url}/ui/app.js").status_code == 200
        assert httpx.get(f"{api.url}/ui/secret.py").status_code == 404

        # no worker yet: the page lists the job as queued
        dom = browser.dom(f"{api.url}/ui")
        assert job_row_status(dom, job_id) == "queued", dom[-3000:]
        assert 'data-state="live"' in dom, "the page did not reach the API"

        stack.start_worker()
        seen = ["queued"]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            stack.check_alive()
            status = job_row_status(browser.dom(f"{api.url}/ui", budget_ms=2000), job_id)
            if status != seen[-1]:
                seen.append(str(status))
            if status in ("succeeded", "failed", "canceled"):
                break
            time.sleep(0.5)
        print(f"statuses seen on the page for job {job_id}: {seen}")
        assert seen[-1] == "succeeded", f"statuses seen on the page: {seen}\n{stack.logs()}"
        assert seen[0] == "queued" and set(seen) <= {"queued", "running", "succeeded"}, seen

        dom = browser.dom(f"{api.url}/ui#job={job_id}", budget_ms=4000)
        row = job_row(dom, job_id)
        assert "succeeded" in row and "48/48" in row and "jacobian" in row and "wide" in row, row
        view = re.search(r'<div id="job-view"[^>]*>', dom)
        assert view and f'data-job-id="{job_id}"' in view.group(0) and 'data-status="succeeded"' in view.group(0)
        assert re.search(r'<img id="jv-preview-img"[^>]*src="blob:', dom), "the preview image was not loaded"
        for text in ("chunk rows", "strategy", "rows/s (now)", "(3, 16, 3, 24)", "rows 48 / 48 (100.0%)"):
            assert text in html.unescape(dom), f"{text!r} not on the job view"

        shot = tmp_path / "ui-screenshot.png"
        browser.screenshot(f"{api.url}/ui#job={job_id}", shot)
        assert png_size(shot.read_bytes()) == WINDOW

        # the preview of the finished job: a block-diagonal Jacobian (examples are independent)
        r = httpx.get(f"{api.url}/v1/jobs/{job_id}/preview.png")
        assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text
        assert r.headers["x-preview-matrix"] == "48x72" and r.headers["x-preview-panels"] == "1/1"
        preview = tmp_path / "preview.png"
        preview.write_bytes(r.content)
        img = decode_png(r.content)
        assert img.shape[0] >= 300 and img.shape[1] >= 400
        reds = (img[..., 0] > 150) & (img[..., 2] < 110)
        blues = (img[..., 2] > 150) & (img[..., 0] < 110)
        assert reds.sum() > 100 and blues.sum() > 100, "no diverging colours in the preview"

        # a batch Jacobian: one panel per example, the first 4 of 6
        batch_id = client.submit("wide", {"x": np.vstack([x, -x])}, kind="batch_jacobian")
        client.wait(batch_id, timeout_s=JOB_TIMEOUT_S, poll_s=0.1)
        r = httpx.get(f"{api.url}/v1/jobs/{batch_id}/preview.png")
        assert r.status_code == 200, r.text
        assert r.headers["x-preview-panels"] == "4/6" and r.headers["x-preview-matrix"] == "16x24"
        (tmp_path / "preview-batch.png").write_bytes(r.content)
        assert decode_png(r.content).shape[1] > 4 * 16 * 8

    if os.environ.get("JACOBIAN_DOCS_IMAGES") == "1":
        shutil.copyfile(shot, REPO / "docs" / "ui-screenshot.png")
