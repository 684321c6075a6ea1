"""``GET /ui``: a page listing jobs with live status and progress, and a job view with its plan,
throughput and preview heatmap. Plain HTML, CSS and vanilla JavaScript from ``app/static`` (no build
step); the page polls ``GET /v1/jobs`` every second and sends the API key the user typed, if any."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(tags=["ui"], include_in_schema=False)


@router.get("/ui")
def ui_page() -> FileResponse:
    """The page (the job list; ``#job=<id>`` opens a job)."""
    return FileResponse(STATIC_DIR / "ui.html", media_type="text/html; charset=utf-8", headers=NO_CACHE)


@router.get("/ui/{name}")
def ui_asset(name: str) -> FileResponse:
    """The page's script and style sheet; nothing else is served from the folder."""
    if name not in ASSETS:
        raise HTTPException(404, f"path: /ui/{name} does not exist; open /ui")
    return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=NO_CACHE)
