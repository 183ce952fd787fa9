"""The operator page at ``/`` (its script and style are under ``/static``; the API docs are at
``/docs``, set up in :func:`anomaly_hooks.serve.app.create_app`)."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parents[1] / "static"

router = APIRouter(tags=["page"], include_in_schema=False)


@router.get("/")
async def page() -> FileResponse:
    """The page: upload an image, see the verdict, the recent results and the drift state."""
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
