"""Edge aggregators: `fedlang serve --upstream URL --upstream-token TOKEN` serves some of a
population's clients exactly as the root would, and is, at the root, a client that holds
seats for them: it mirrors the root's rounds and buffered sessions in its own store,
folds its clients' reports there (in a secure round, runs SecAgg+ over them), and
forwards one partial aggregate per round, and its session reports in batches.

- `sync.py`: `Edge`, a `Server` and the one loop that mirrors the root's tasks over a
  `{TaskKind: Mirror}` table (what it keeps of the root: `store/mirrors.py`).
"""
