"""Browser clients: a web page joins a deployment and trains on its own data.

A round's client task is exported to ONNX (`task.py`, `onnx_export.py`, with fedlang's
conversion rules for what jax2onnx gets wrong in `rules.py`), checked against JAX by the
preflight (`verify.py`) and added to the round's plan, signed with it. Pages run it
with `fedlang.js` and onnxruntime-web, both served by `fedlang serve --browser`
(`routes.py`, `assets.py`). Exporting needs the `browser` extra (jax2onnx, onnx,
onnxruntime). See docs/deploy.md, "Browser clients".
"""

from fedlang.deploy.browser.onnx_export import BrowserExportError as BrowserExportError
from fedlang.deploy.browser.runner import run_task as run_task
from fedlang.deploy.browser.runner import run_task_with_state as run_task_with_state
from fedlang.deploy.browser.verify import BrowserTasks as BrowserTasks
from fedlang.deploy.browser.verify import preflight as preflight
