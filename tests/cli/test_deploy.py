"""`fedlang serve`, `fedlang client` and `fedlang status URL` (src/fedlang/cli/deploy.py),
through the real command: how they start, refuse and stop."""

import concurrent.futures
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from fedlang import deploy
from fedlang.cli import deploy as deploy_cli

from ._run import ENV, fedlang, fedlang_all, one_sentence_error, start_fedlang


@pytest.fixture
def server(tmp_path):
    """An in-process server on 127.0.0.1 with population `pop` (stopped at the end)."""
    with deploy.Server(db=tmp_path / "server.db", port=0) as s:
        with deploy.Admin(s.url, s.admin_token) as admin:
            s.token = admin.create_population("pop")
        yield s


def _enrollments(server):
    with deploy.Admin(server.url, server.admin_token) as admin:
        return admin.status()["enrollments"]


def _wait_for(text, path, process, timeout=120):
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert process.poll() is None, f"it ended before saying {text!r}: {path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s"
        time.sleep(0.05)


def _stopped_by(signum, d, args, ready, stream="stdout.txt"):
    """Starts `fedlang *args` in `d`, waits until it says `ready`, sends `signum`."""
    d.mkdir()
    process, finish = start_fedlang(*args, cwd=d)
    _wait_for(ready, d / stream, process)
    process.send_signal(signum)
    return finish(timeout=60)


def test_serve_stops_on_sigint_and_sigterm_saying_what_it_kept(tmp_path):
    # it stopped with no word and status 0; now 130 (Ctrl-C) and 143 (SIGTERM), as shells
    # report a process a signal stopped, and it says where acknowledged reports are
    signals = [signal.SIGINT, signal.SIGTERM]
    dirs = [tmp_path / s.name for s in signals]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(
            lambda s, d: _stopped_by(s, d, ["serve", "--db", d / "store.db", "--port", "0",
                                            "--population", "pop"], "population pop token"),
            signals, dirs))
    for signum, d, (status, _, err) in zip(signals, dirs, results, strict=True):
        assert status == 128 + signum, (signum, status, err)
        text = " ".join(err.split())
        label = "Interrupted" if signum == signal.SIGINT else "Terminated"
        assert text == (f"{label}: the server stopped; every report it acknowledged is kept in the "
                        f"SQLite database {d / 'store.db'} (the same command serves it "
                        "again); clients retry until it is back, for their --patience."), text
    # the same command serves the database again: the lock went with the process
    again = _stopped_by(signal.SIGINT, tmp_path / "again",
                        ["serve", "--db", dirs[0] / "store.db", "--port", "0"],
                        "admin token")
    assert again[0] == 130, again[2]


def test_a_client_stops_on_sigint_and_sigterm_saying_what_it_kept(tmp_path, server):
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 3), np.float32))
    signals = [signal.SIGINT, signal.SIGTERM]
    dirs = [tmp_path / s.name for s in signals]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(
            lambda s, d: _stopped_by(
                s, d, ["client", "--server", server.url, "--population", "pop", "--token",
                       server.token, "--data", f"train={tmp_path / 'data.npz'}",
                       *(["--credential-file", d / "cred.json"] if s == signal.SIGINT else [])],
                "enrolled as", stream="stderr.txt"),
            signals, dirs))
    for signum, d, (status, _, err) in zip(signals, dirs, results, strict=True):
        assert status == 128 + signum, (signum, status, err)
        assert "Traceback" not in err, err
        said = " ".join(err.split())
        if signum == signal.SIGINT:  # waiting for a task: it stops at once
            assert said.endswith(
                "Interrupted: the client stopped after 0 tasks; its credential is kept in "
                f"{d / 'cred.json'} (the same command rejoins as the same client)."), said
            assert (d / "cred.json").exists()
        else:
            assert said.endswith(
                "Terminated: the client stopped after 0 tasks; it kept nothing (run again, it "
                "enrolls as a new client; --credential-file F keeps its credential)."), said


def test_a_client_checks_every_data_path_before_it_enrolls(tmp_path, server):
    # a missing file was found only when a task came: the client enrolled and waited
    # forever; now each --data is checked first, and the message names it and the fix
    good = tmp_path / "good.npz"
    np.savez(good, x=np.zeros((4, 3), np.float32))
    (tmp_path / "text.npz").write_text("x,y\n1,2\n")
    np.savez(tmp_path / "ragged.npz", x=np.zeros((4, 3), np.float32), y=np.zeros(3, np.int32))
    (tmp_path / "rows.csv").write_text("x,y\n1,2\n")
    cases = {
        tmp_path / "missing.npz": ["found nothing there", "check the path"],
        tmp_path / "text.npz": ["to be an .npz file of numeric arrays", "numpy.savez"],
        tmp_path / "ragged.npz": ["as many rows each", "'x': '4 rows', 'y': '3 rows'"],
        tmp_path / "rows.csv": ["an .npz file of arrays", "fedlang data convert"],
        tmp_path / "nowhere": ["found nothing there"],
    }
    base = ["client", "--server", server.url, "--population", "pop", "--token", server.token]
    results = fedlang_all(*([*base, "--data", f"train={good}", "--data", f"test={bad}"]
                            for bad in cases), timeout=60)
    for (bad, fragments), result in zip(cases.items(), results, strict=True):
        one_sentence_error(result, 1, str(bad), f"(--data test={bad})", *fragments)
    assert _enrollments(server) == 0


def test_an_unknown_population_is_named_as_such_not_blamed_on_the_token(tmp_path, server):
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 3), np.float32))
    result = fedlang("client", "--server", server.url, "--population", "digitz", "--token",
                     server.token, "--data", f"train={tmp_path / 'data.npz'}", timeout=60)
    one_sentence_error(result, 1, "found no population named 'digitz' on this server",
                       "`fedlang status URL` lists the populations",
                       "`fedlang serve --population digitz`")
    assert "token" not in result[2] and "a unknown" not in result[2]


def test_serve_names_a_port_in_use_and_refuses_a_database_another_server_holds(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = fedlang("serve", "--db", tmp_path / "other.db", "--port", port, timeout=60)
    one_sentence_error(in_use, 1, f"Expected port {port} on 127.0.0.1 to be free",
                       "--port N", "--port 0")
    # a server holds the database; a second one is refused; after kill -9 it starts
    db = tmp_path / "store.db"
    first, finish = start_fedlang("serve", "--db", db, "--port", "0", cwd=tmp_path)
    try:
        _wait_for("admin token", tmp_path / "stdout.txt", first)
        second = fedlang("serve", "--db", db, "--port", "0", timeout=60)
        one_sentence_error(second, 1, f"Expected no other server on the task store {db}",
                           f"pid {first.pid}", f"lock file {db}.lock", "--db")
        first.kill()  # kill -9: no clean-up ran; the kernel dropped the lock
    finally:
        status, _, _ = finish(timeout=60)
    assert status == -signal.SIGKILL
    with deploy.Server(db=db, port=0):
        pass


def test_a_malformed_url_fails_at_once_and_patience_is_seconds(tmp_path):
    # these were retried (13 s) before failing as unreachable
    bad = ["not-a-url", "htp://127.0.0.1:8000", "127.0.0.1:8000"]
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        results = fedlang_all(*(["status", url] for url in bad),
                              ["status", f"http://127.0.0.1:{port}", "--patience", "1"], timeout=60)
    for url, result in zip(bad, results[:-1], strict=True):
        one_sentence_error(result, 1, "Expected the server's URL as http://HOST:PORT", repr(url),
                           "did you mean http://")
    one_sentence_error(results[-1], 1, f"Expected the server at http://127.0.0.1:{port}",
                       "for 1 s (patience 1 s)")


def test_status_refuses_a_malformed_url_without_retrying_for_its_patience():
    # with --patience 600 it retried for ten minutes; it is refused before the first try
    status, _, err = fedlang("status", "htp://127.0.0.1:8000", "--patience", "600", timeout=60)
    assert status == 1 and err.startswith("Error: Expected the server's URL"), err


def test_status_keeps_its_full_table_in_a_file_and_prints_json(server):
    # written to a file it was cut to 80 columns (`rou… pop… sta…`); issue 26
    name = "a-population-whose-name-makes-the-row-wider-than-80-columns"
    with deploy.Admin(server.url, server.admin_token) as admin:
        admin.create_population(name)
    env = {k: v for k, v in ENV.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "fedlang", "status", server.url],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert name in out.stdout and "…" not in out.stdout
    out = subprocess.run([sys.executable, "-m", "fedlang", "status", server.url, "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    doc = json.loads(out.stdout)
    assert [p["name"] for p in doc["populations"]] == sorted(["pop", name])
    assert doc["enrollments"] == _enrollments(server)


def test_serve_refuses_a_pace_that_cannot_be_kept(tmp_path):
    refused = fedlang("serve", "--db", tmp_path / "store.db", "--port", "0",
                      "--min-retry", 10, "--max-retry", 5, timeout=60)
    one_sentence_error(refused, 1, "0 < min_retry <= max_retry", "min_retry 10.0")


def test_an_edge_needs_its_root_and_a_token_the_root_made(tmp_path, server):
    alone, ephemeral, refused = fedlang_all(
        ["serve", "--db", tmp_path / "a.db", "--port", "0", "--upstream", server.url],
        ["serve", "--db", tmp_path / "b.db", "--port", "0", "--ephemeral"],
        ["serve", "--db", tmp_path / "c.db", "--port", "0", "--upstream", server.url,
         "--upstream-token", "not-a-token"],
        timeout=120,
    )
    one_sentence_error(alone, 2, "--upstream URL and --upstream-token TOKEN together")
    one_sentence_error(ephemeral, 2, "--upstream URL with --ephemeral")
    one_sentence_error(refused, 1, f"the root at {server.url} to take this edge",
                       "Expected an edge token made by the root's admin")


def test_an_ephemeral_edge_stops_on_sigterm_saying_that_it_kept_nothing(tmp_path, server):
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_edge("east", "pop")
    status, out, err = _stopped_by(
        signal.SIGTERM, tmp_path / "edge",
        ["serve", "--port", "0", "--upstream", server.url, "--upstream-token", token,
         "--ephemeral"], "population pop token")
    assert f"edge aggregator of {server.url}, population pop" in out
    assert status == 143, err
    assert " ".join(err.split()) == (
        "Terminated: the ephemeral edge stopped and its store is removed: the root counts its "
        "clients as dropouts of the rounds it held."), err
    store = out.split("(database ")[1].split(")")[0]
    assert not pathlib.Path(store).parent.exists()  # the temporary store is gone


def test_serve_workers_refuses_sqlite_a_bad_count_and_one_metrics_port(tmp_path):
    pg = "postgresql://nobody@127.0.0.1:1/none"  # refused before anything connects
    sqlite, zero, metrics, edge = fedlang_all(
        ["serve", "--db", tmp_path / "a.db", "--port", "0", "--workers", "2"],
        ["serve", "--db", pg, "--port", "0", "--workers", "0"],
        ["serve", "--db", pg, "--port", "0", "--workers", "2", "--metrics-port", "0"],
        ["serve", "--db", pg, "--port", "0", "--workers", "2", "--upstream", "http://x",
         "--upstream-token", "t"],
        timeout=120,
    )
    one_sentence_error(sqlite, 2, "a PostgreSQL database with --workers", "SQLite is one process",
                       "--db postgresql://")
    one_sentence_error(zero, 2, "--workers N with N >= 1", "found 0")
    one_sentence_error(metrics, 2, "no --metrics-port with --workers 2", "admin token")
    one_sentence_error(edge, 2, "no --upstream with --workers")


def test_serve_refuses_a_database_in_a_directory_that_does_not_exist(tmp_path):
    # it made the directories and a second, empty deployment with a new admin token
    missing = tmp_path / "nonexistent" / "dir"
    (tmp_path / "a-file").write_text("")
    in_none, in_file, as_url = fedlang_all(
        ["serve", "--db", missing / "x.db", "--port", "0"],
        ["serve", "--db", tmp_path / "a-file" / "x.db", "--port", "0"],
        ["serve", "--db", f"sqlite:///{missing / 'x.db'}", "--port", "0"], cwd=tmp_path,
        timeout=120)
    one_sentence_error(in_none, 1, f"Expected the directory {missing} of --db {missing / 'x.db'} "
                       f"to exist, found none; create it first (mkdir -p {missing})")
    one_sentence_error(in_file, 1, f"found {tmp_path / 'a-file'} a file")
    one_sentence_error(as_url, 1, f"Expected the directory {missing} of --db sqlite:///")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing made
    for db in ("postgresql://nobody@127.0.0.1:1/none", "postgres://u:p@db.example/x/y",
               ":memory:", "sqlite:///:memory:", "store.db"):  # not refused
        deploy_cli._check_directory(db)


def test_serve_names_a_postgresql_server_it_cannot_reach_in_one_sentence(tmp_path):
    # it printed psycopg's OperationalError as a 40-line traceback; the password is hidden
    with socket.socket() as closed:  # a loopback port where nothing listens
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        result = fedlang("serve", "--db", f"postgresql://fl:s3cret@127.0.0.1:{port}/store",
                         "--key-file", tmp_path / "k.key", "--port", "0", cwd=tmp_path,
                         timeout=120)
    one_sentence_error(result, 1, "Expected the PostgreSQL server of "
                       f"postgresql://fl:***@127.0.0.1:{port}/store to accept a connection",
                       "Check that it runs and that the URL")
    assert "s3cret" not in result[1] + result[2]


def test_a_corrupt_credential_file_is_named_with_the_fix(tmp_path):
    # it said only "Error: Expecting property name enclosed in double quotes: line 1
    # column 2 (char 1)" (or "Error: 'client_id'")
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 3), np.float32))
    files = {"quotes.json": "{'client_id': 'c-1'}", "fields.json": '{"server": "http://x"}'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with socket.socket() as closed:  # never reached: the file is read first
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        quotes, fields = fedlang_all(*(
            ["client", "--server", url, "--population", "pop", "--data",
             f"train={tmp_path / 'data.npz'}", "--credential-file", tmp_path / name]
            for name in files), timeout=120)
    fix = "; delete it to enroll again as a new client (with the population's token)."
    one_sentence_error(quotes, 1, f"Expected the credential file {tmp_path / 'quotes.json'} to "
                       "hold this client's credential (JSON), found invalid JSON (Expecting "
                       "property name enclosed in double quotes: line 1 column 2 (char 1))" + fix)
    one_sentence_error(fields, 1, f"Expected the credential file {tmp_path / 'fields.json'} to "
                       "hold this client's credential (JSON with client_id, credential, "
                       "public_key), found JSON without client_id, credential, public_key" + fix)
    for name, text in files.items():
        assert (tmp_path / name).read_text() == text  # left for the user to look at


def _client(tmp_path, url, *args):
    return ["client", "--server", url, "--population", "pop", "--data",
            f"train={tmp_path / 'data.npz'}", *args]


def _said(err, text):
    """The lines of a client's log (after its time stamp) that start with `text`."""
    lines = [line.split(" ", 2)[-1] for line in err.splitlines()]
    return [line for line in lines if line.startswith(text)]


def test_a_client_says_at_once_that_the_server_is_unreachable(tmp_path):
    # it was silent for its whole --patience (300 s by default)
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 3), np.float32))
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        status, _, err = fedlang(*_client(tmp_path, url, "--token", "t", "--patience", "3"),
                                 timeout=120)
    assert status == 1 and "Traceback" not in err, err
    assert _said(err, "server unreachable") == [  # once, not at each of its tries
        f"server unreachable at {url} (ConnectError: [Errno 111] Connection refused), "
        "retrying for up to 3 s"], err
    assert err.splitlines()[-1].startswith(f"Error: Expected the server at {url}"), err


def test_a_running_client_says_when_it_loses_the_server_and_gets_it_back(tmp_path):
    # a server restart went by with no word; a rejoining client did not say it was in
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 3), np.float32))
    db, (d, again) = tmp_path / "server.db", (tmp_path / "client", tmp_path / "again")
    d.mkdir()
    again.mkdir()
    first = deploy.Server(db=db, port=0).start()
    try:
        with deploy.Admin(first.url, first.admin_token) as admin:
            token = admin.create_population("pop")
        process, finish = start_fedlang(
            *_client(tmp_path, first.url, "--token", token, "--credential-file",
                     tmp_path / "cred.json", "--patience", "120"), cwd=d)
        _wait_for("enrolled as", d / "stderr.txt", process)
    finally:
        first.stop()
    try:
        _wait_for("server unreachable", d / "stderr.txt", process)
        with deploy.Server(db=db, port=first.port):  # the same server again
            _wait_for("server reachable again", d / "stderr.txt", process)
            process.send_signal(signal.SIGTERM)
            status, _, err = finish(timeout=60)
            # run again, it rejoins with its credential
            process, finish = start_fedlang(*_client(tmp_path, first.url, "--credential-file",
                                                     tmp_path / "cred.json"), cwd=again)
            _wait_for("rejoined as", again / "stderr.txt", process)
            process.send_signal(signal.SIGTERM)
            rejoined = finish(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            finish(timeout=60)
    assert status == 143, err
    lost = _said(err, "server unreachable")
    assert len(lost) == 1 and lost[0].startswith(f"server unreachable at {first.url} ("), err
    assert lost[0].endswith("), retrying for up to 120 s"), err
    back = _said(err, "server reachable again")
    assert len(back) == 1 and re.fullmatch(r"server reachable again after \d+\.\d s", back[0]), err
    client_id = json.loads((tmp_path / "cred.json").read_text())["client_id"]
    assert rejoined[0] == 143, rejoined[2]
    assert _said(rejoined[2], "rejoined") == [
        f"rejoined as {client_id} (credential {tmp_path / 'cred.json'})"], rejoined[2]
