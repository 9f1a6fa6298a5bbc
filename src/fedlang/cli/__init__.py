"""The `fedlang` command line (`fedlang --help`, or `python -m fedlang --help`).

One module per command group, each adding its commands to `app` with `register(app)`:

- `training`: `fedlang demo` and `fedlang train CONFIG.toml`;
- `experiment`: the experiment config those two run (TOML tables, defaults, checks);
- `data`: `fedlang data inspect` and `fedlang data convert`;
- `deploy`: the deployment's `fedlang serve`, `fedlang client` and `fedlang status`;
- `ops`: an operator's listings (`fedlang populations`, `rounds`, `sessions`), `fedlang
  follow` and `fedlang stop-round` / `stop-session`;
- `console`: the one console every command prints with, and `fail`, the one way to
  stop with an error and an exit status.

The commands that need an extra's packages are listed in `NEEDS`: each checks them
before it runs (a missing one is a sentence naming it and the pip command, never a
traceback), and `fedlang --help` lists them.
"""

from __future__ import annotations

import functools
import importlib.util
import textwrap
from collections.abc import Callable
from typing import Annotated, Any

import typer

from fedlang.cli import console, data, deploy, experiment, ops, training

# The modules a command imports that fedlang's own dependencies leave to an extra:
# command -> (the extra, the modules). A server needs the web stack; everything else
# that talks to one needs only the HTTP client.
_SERVER = ("fastapi", "uvicorn", "httpx", "prometheus_client")
_HTTP = ("httpx",)
NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("deploy", _SERVER),
    **{command: ("deploy", _HTTP) for command in (
        "client", "status", "revoke", "rotate-token", "device-tokens", "enroll-bulk",
        "populations", "rounds", "sessions", "follow", "stop-round", "stop-session")},
}


def _epilog() -> str:
    """What `fedlang --help` says after the commands: which need which extra (a block
    click shows as it is, `\\b`, wrapped here without breaking a name at its hyphen)."""
    by_extra: dict[str, list[str]] = {}
    for command, (extra, _) in NEEDS.items():
        by_extra.setdefault(extra, []).append(command)
    lines = [f"{extra}: {', '.join(commands)}" for extra, commands in by_extra.items()]
    for dataset, (_, package, extra) in experiment.NEEDS.items():  # the demo's digits
        lines.append(f"{extra}: demo, and train on the {dataset} dataset ({package})")
    wrapped = [textwrap.fill(line, 78, initial_indent="  ", subsequent_indent="    ",
                             break_on_hyphens=False) for line in lines]
    return "\b\nCommands that need an extra (pip install 'fedlang[EXTRA]'):\n" + "\n".join(wrapped)


# Plain click help (rich_markup_mode=None): typer's rich panels print a type placeholder
# such as <bool> even for a flag, which takes no value.
app = typer.Typer(
    help="fedlang: federated learning on JAX. Start with `fedlang demo`.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        import fedlang

        console.out.print(f"fedlang {fedlang.__version__}", highlight=False)
        raise typer.Exit()


@app.callback(epilog=_epilog())
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print fedlang's version and exit.")] = False,
) -> None:
    """fedlang: federated learning on JAX. Start with `fedlang demo`."""


def _installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it (a server's imports
    take seconds: `serve` notes Ctrl-C before it makes them)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # e.g. a broken install whose finder raises
        return False


def _checking_needs(name: str, command: Callable[..., Any]) -> Callable[..., Any]:
    """`command`, refusing (status 1) to run when a module `NEEDS[name]` lists is missing;
    its help still shows without them."""
    extra, modules = NEEDS[name]

    @functools.wraps(command)  # typer reads the wrapped function's parameters and docstring
    def checked(*args: Any, **kwargs: Any) -> Any:
        missing = [m for m in modules if not _installed(m)]
        if missing:
            names = " and ".join(filter(None, [", ".join(missing[:-1]), missing[-1]]))
            console.fail(f"Expected {names}, which `fedlang {name}` needs, found "
                         f"{'it' if len(missing) == 1 else 'them'} not installed. Install "
                         f"the {extra} extra: pip install 'fedlang[{extra}]'.")
        return command(*args, **kwargs)

    return checked


training.register(app)
data.register(app)
deploy.register(app)
ops.register(app)
for _info in app.registered_commands:
    assert _info.callback is not None  # every command is registered with its function
    _name = _info.name or typer.main.get_command_name(_info.callback.__name__)
    if _name in NEEDS:
        _info.callback = _checking_needs(_name, _info.callback)


def main() -> None:
    """The console-script entry point."""
    app()
