"""The operator's dashboard: a page at `/dashboard/` that shows a deployment live.

`mount(app)` serves, outside the versioned API:

* `GET /dashboard/`: the page (`static/dashboard/`: HTML, CSS and JavaScript modules, no
  build step). It asks for the admin token, keeps it in the tab's sessionStorage and
  sends it as a bearer token to the admin API (`GET /v1/admin/overview`, `GET
  /v1/admin/populations/{name}/metrics`), polling every 2 s (`?interval=SECONDS`). The
  page itself holds no data: without the token it shows nothing but the form.
* `GET /dashboard/uplot/...`: uPlot, the charting library (`fedlang.deploy.assets.UPLOT`:
  pinned and SHA-256 checked, in every wheel). Without it the page still shows its
  tables and says how to get the charts.

Every file goes out with a strict content-security policy (`CSP`: scripts, styles and
requests only from this server, no inline script or style, no framing), so that a
value an attacker put in a population's name or a metric could not run as script even
if the page wrote it as HTML, which it does not (it sets text only).
"""

from __future__ import annotations

import pathlib
from typing import Any

from fedlang.deploy import assets
from fedlang.deploy.server import routing

STATIC = pathlib.Path(__file__).resolve().parent / "static" / "dashboard"
PATH = "/dashboard/"
CSP = "; ".join([
    "default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
    "img-src 'self' data:", "base-uri 'none'", "form-action 'self'", "frame-ancestors 'none'",
])
HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
           "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


def missing() -> list[str]:
    """uPlot's files the server lacks (the page then shows no charts)."""
    return assets.UPLOT.missing()


def mount(app: Any) -> None:
    """Serves the dashboard from `app`, a FastAPI application (with uPlot when its
    checked files are there: `missing()`)."""
    if not missing():
        # pinned: a browser may keep it; the page changes with fedlang: revalidate it
        app.mount("/dashboard/uplot", routing.static_files(
            assets.UPLOT.directory(), "public, max-age=86400", HEADERS), name="dashboard-uplot")
    app.mount("/dashboard", routing.static_files(STATIC, "no-cache", HEADERS), name="dashboard")
