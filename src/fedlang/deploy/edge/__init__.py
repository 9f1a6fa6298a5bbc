"""Edge aggregators: `fedlang serve --upstream URL --upstream-token TOKEN` serves some of a
population's clients exactly as the root would, mirrors the root's rounds in its own
store, folds its clients' reports there (in a secure round, runs SecAgg+ over them), and
forwards one partial aggregate per round to the root; it mirrors buffered sessions too,
forwarding their reports in batches (`edge.Edge`; the root's side is `server/edges.py`
and `store/edges.py`; what the edge keeps of the root is `store/upstream.py`).

- `link.py`: HTTP to the root, by the edge's token.
- `edge.py`: `Edge`, a `Server` and the thread that mirrors rounds and forwards partials.
- `sessions.py`: buffered sessions: the thread that mirrors the root's sessions and
  forwards its clients' reports in batches.
"""
