"""The server's routes for browser clients: the JavaScript client and a demo page.

`mount(app, demo=...)` adds, outside the versioned API:

* `GET /browser/fedlang.js`: the client module (`FedlangClient`, see docs/deploy.md);
* `GET /browser/ort/...`: onnxruntime-web's files (`assets.py`), which it imports;
* with `demo=True`, `GET /demo/`: a page that trains on an `.npz` file the user picks
  and shows progress.

The page and the client come from the server they talk to, so no cross-origin requests
are needed. WebCrypto (which verifies plan signatures) needs a secure context: serve
over TLS, or open the page at http://127.0.0.1 or http://localhost.
"""

from __future__ import annotations

from typing import Any

from fedlang.deploy.browser import assets
from fedlang.deploy.server import routing


def mount(app: Any, demo: bool = False) -> None:
    """Serves the browser client (and the demo page) from `app`, a FastAPI application.

    Raises:
      FileNotFoundError: when onnxruntime-web's files are missing (how to get them).
    """
    ort = assets.check()
    # The client changes with fedlang: revalidate it; onnxruntime-web's files are pinned.
    app.mount("/browser/ort", routing.static_files(ort, "public, max-age=86400"), name="browser-ort")
    app.mount("/browser", routing.static_files(assets.STATIC, "no-cache"), name="browser")
    if demo:
        app.mount("/demo", routing.static_files(assets.DEMO, "no-cache"), name="demo")
