"""The `fedlang` app (src/fedlang/cli/__init__.py): the entry points and the command groups."""

import concurrent.futures
import re
import subprocess
import sys

import typer

from fedlang import cli
from fedlang.cli import deploy, ops

from ._run import ENV, fedlang, fedlang_all


def test_python_dash_m_fedlang_help():
    out = subprocess.run([sys.executable, "-m", "fedlang", "--help"], capture_output=True,
                         text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr
    for command in ("demo", "train", "data", "serve", "client", "status", "revoke", "rotate-token",
                    "device-tokens"):
        assert command in out.stdout, command


def test_version():
    status, stdout, _ = fedlang("--version")
    assert status == 0 and stdout.strip() == "fedlang 0.1.0"


COMMANDS = [[], ["demo"], ["train"], ["serve"], ["client"], ["status"], ["data"],
            ["data", "inspect"], ["data", "convert"]]


def test_help_shows_flags_bare_and_names_what_each_option_takes():
    # typer's rich panels printed <bool> beside flags, which take no value, and <str>
    # beside options whose value a user must guess
    for command, (status, stdout, stderr) in zip(
            COMMANDS, fedlang_all(*([*c, "--help"] for c in COMMANDS)), strict=True):
        assert status == 0, (command, stderr)
        assert "Options:\n" in stdout, stdout  # click's plain help, not typer's panels
        options = stdout.split("Options:\n", 1)[1].split("\n\n", 1)[0]
        for line in options.splitlines():
            if not line.startswith("  -"):
                continue  # a wrapped help text
            usage = line.strip().split("  ", 1)[0]
            assert "<" not in usage, (command, line)
            flag = " / " in usage or usage in ("--help", "--version")
            assert flag or re.fullmatch(r"--[a-z-]+ [A-Z=]+", usage), (command, line)


# Imported, these raise as they would were the deploy extra not installed (a finder
# first on sys.meta_path, put there by a sitecustomize first on the path): find_spec
# and import both fail.
_WITHOUT_DEPLOY = '''
import sys

MISSING = {"fastapi", "starlette", "uvicorn", "httpx", "psycopg", "prometheus_client"}


class _Missing:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Missing)
'''


def test_deploy_commands_without_the_deploy_extra_name_what_to_install(tmp_path):
    # each printed a 30-line traceback ending in "No module named 'httpx'" (enroll-bulk
    # after making its --out file); now one sentence, before anything is made
    blocker = tmp_path / "no_deploy"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_WITHOUT_DEPLOY)
    url = "http://127.0.0.1:1"
    commands = {
        "serve": ["serve", "--db", tmp_path / "x.db", "--port", "0"],
        "client": ["client", "--server", url, "--population", "p", "--data", "x=d.npz"],
        "status": ["status", url],
        "follow": ["follow", url, "1", "--admin-token", "t"],
        "enroll-bulk": ["enroll-bulk", url, "p", "2", "--admin-token", "t", "--out",
                        tmp_path / "creds.ndjson"],
        "populations": ["populations", url, "--admin-token", "t"],
    }
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = dict(zip(commands, pool.map(
            lambda args: fedlang(*args, cwd=tmp_path, path_first=blocker, timeout=120),
            commands.values()), strict=True))
    for name, (status, stdout, stderr) in results.items():
        assert status == 1, (name, stderr)
        assert "Traceback" not in stderr and stdout == "", (name, stderr)
        needs = "fastapi, uvicorn, httpx and prometheus_client" if name == "serve" else "httpx"
        assert stderr.split() == (
            f"Error: Expected {needs}, which `fedlang {name}` needs, found "
            f"{'them' if name == 'serve' else 'it'} not installed. Install the deploy extra: "
            "pip install 'fedlang[deploy]'.").split(), (name, stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_deploy"]  # nothing made
    # their help needs nothing more
    status, stdout, stderr = fedlang("serve", "--help", path_first=blocker, timeout=120)
    assert status == 0 and "Serve a task store" in stdout, stderr


def test_train_releasing_metrics_without_the_deploy_extra_names_what_to_install(tmp_path):
    # it said only "Error: No module named 'httpx'", after loading the data
    blocker = tmp_path / "no_deploy"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_WITHOUT_DEPLOY)
    (tmp_path / "exp.toml").write_text(
        '[data]\ndataset = "digits"\nnum_clients = 4\n[model]\nkind = "softmax"\n'
        f'[training]\nrounds = 1\ncohort_size = 2\n[output]\ndir = "{tmp_path / "run"}"\n')
    status, _, stderr = fedlang(
        "train", "exp.toml", "--metrics-server", "http://127.0.0.1:1", "--metrics-population",
        "p", "--admin-token", "t", "--no-progress", cwd=tmp_path, path_first=blocker,
        timeout=120)
    assert status == 1 and "Traceback" not in stderr, stderr
    assert " ".join(stderr.split()) == (
        "Error: Expected httpx, which releasing metrics to a server (output.server, "
        "--metrics-server) needs, found it not installed (No module named 'httpx'). Install "
        "the deploy extra: pip install 'fedlang[deploy]'.")
    assert not (tmp_path / "run").exists()


def test_help_says_which_commands_need_which_extra():
    status, stdout, _ = fedlang("--help")
    assert status == 0
    said = " ".join(stdout.split("Commands that need an extra", 1)[1].split())
    assert said == (
        "(pip install 'fedlang[EXTRA]'): deploy: serve, client, status, revoke, rotate-token, "
        "device-tokens, enroll-bulk, populations, rounds, sessions, follow, stop-round, "
        "stop-session examples: demo, and train on the digits dataset (scikit-learn)"), said


def test_every_deployment_command_checks_the_deploy_extra():
    # a command added to cli/deploy.py or cli/ops.py is checked only once NEEDS lists it
    app = typer.Typer()
    deploy.register(app)
    ops.register(app)
    names = {c.name or typer.main.get_command_name(c.callback.__name__)
             for c in app.registered_commands}
    assert names == {n for n, (extra, _) in cli.NEEDS.items() if extra == "deploy"}
