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

import pathlib
from typing import Any

from fedlang.deploy.browser import assets

_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
          ".svg": "image/svg+xml",
          ".html": "text/html; charset=utf-8", ".css": "text/css", ".txt": "text/plain"}


def _static(directory: pathlib.Path, cache: str) -> Any:
    from starlette import staticfiles

    class Static(staticfiles.StaticFiles):
        """Static files with the MIME types browsers require of modules and wasm."""

        def file_response(self, full_path: Any, *args: Any, **kwargs: Any) -> Any:
            response = super().file_response(full_path, *args, **kwargs)
            suffix = pathlib.Path(str(full_path)).suffix
            if suffix in _TYPES:
                response.headers["content-type"] = _TYPES[suffix]
            response.headers["cache-control"] = cache
            return response

    return Static(directory=directory, html=True)


def mount(app: Any, demo: bool = False) -> None:
    """Serves the browser client (and the demo page) from `app`, a FastAPI application.

    Raises:
      FileNotFoundError: when onnxruntime-web's files are missing (how to get them).
    """
    ort = assets.check()
    # The client changes with fedlang: revalidate it; onnxruntime-web's files are pinned.
    app.mount("/browser/ort", _static(ort, "public, max-age=86400"), name="browser-ort")
    app.mount("/browser", _static(assets.STATIC, "no-cache"), name="browser")
    if demo:
        app.mount("/demo", _static(assets.DEMO, "no-cache"), name="demo")
