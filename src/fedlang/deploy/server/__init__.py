"""The task store's HTTP server (FastAPI): handlers parse, call the store, shape the answer.

* `app`: the application: routers, refusals as JSON, the deadline tick;
* `serve`: `Server`, which runs it (uvicorn), and the signing key;
* `state`: what every route reads (`ServerState`); `auth`: who is asking;
* `routing`: what route modules share; `schemas`: the JSON bodies;
* `intake`: the one upload pipeline every mode's uploads pass;
* `plans`: reading, checking and signing a new task's plan;
* `common`, `rounds`, `secure`, `sessions`: the routes (populations, enrollment,
  check-in, blobs, status; plain rounds; secure rounds; buffered sessions).
"""
