"""Running the `fedlang` command in tests: typer's CliRunner in this process, and the
real command (`python -m fedlang` with this checkout's sources) in a subprocess."""

import concurrent.futures
import os
import pathlib
import subprocess
import sys

from typer.testing import CliRunner

from fedlang import cli

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "COLUMNS": "200"}

_runner = CliRunner()


def invoke(*args):
    """The command in this process (typer's CliRunner): its `exit_code` and `output`."""
    return _runner.invoke(cli.app, [str(a) for a in args])


def fedlang(*args, cwd=None, path_first=None, timeout=300):
    """Runs the real `fedlang` command; returns (exit status, stdout, stderr).

    `path_first`: a directory put before everything on the module path. `timeout`:
    seconds before it is killed (and `subprocess.TimeoutExpired` raised).
    """
    env = ENV if path_first is None else {
        **ENV, "PYTHONPATH": f"{path_first}{os.pathsep}{ENV['PYTHONPATH']}"}
    out = subprocess.run([sys.executable, "-m", "fedlang", *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=cwd)
    return out.returncode, out.stdout, out.stderr


def fedlang_all(*commands, cwd=None, timeout=300):
    """Several commands at once (each is a fresh process: most of its time is imports)."""
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda c: fedlang(*c, cwd=cwd, timeout=timeout), commands))


def one_sentence_error(result, code, *fragments):
    """Asserts that `result` (of `fedlang`) exited with `code` and said one sentence on
    stderr, "Error: Expected ...", containing each of `fragments`."""
    status, _, err = result
    assert status == code, err[-2000:]
    assert "Traceback" not in err
    text = " ".join(err.split())
    assert text.startswith("Error: Expected"), text
    for f in fragments:
        assert f in text, (f, text)


def fedlang_in_terminal(*args, cwd=None, env=None, columns=200):
    """Runs the real `fedlang` command with stdout and stderr on a pseudo-terminal (as a
    user sees it: progress bar and all); returns (exit status, what the terminal got,
    escape sequences removed, split into the lines and redraws it showed)."""
    import pty
    import re
    import select

    main, terminal = pty.openpty()
    os.set_inheritable(terminal, True)
    process = subprocess.Popen(
        [sys.executable, "-m", "fedlang", *map(str, args)], stdin=subprocess.DEVNULL,
        stdout=terminal, stderr=terminal, cwd=cwd, close_fds=True,
        env={**ENV, "COLUMNS": str(columns), "TERM": "xterm", **(env or {})})
    os.close(terminal)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 300)
            if not ready:
                raise TimeoutError(f"fedlang {args} said nothing for 300 s")
            try:
                data = os.read(main, 65536)
            except OSError:  # the terminal closed: the command ended
                break
            if not data:
                break
            chunks.append(data)
        status = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(main)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    return status, [line for line in re.split(r"[\r\n]+", text) if line.strip()]


def start_fedlang(*args, cwd):
    """Starts the real `fedlang` command (stdout and stderr to files in `cwd`); returns
    its Popen and a function that waits for it and returns (status, stdout, stderr)."""
    out, err = open(cwd / "stdout.txt", "w"), open(cwd / "stderr.txt", "w")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-m", "fedlang", *map(str, args)],
                               stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=ENV, cwd=cwd)

    def finish(timeout=240):
        try:
            status = process.wait(timeout=timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()
        return status, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text()

    return process, finish
