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
"""

from __future__ import annotations

from typing import Annotated

import typer

from fedlang.cli import console, data, deploy, ops, training

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


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print fedlang's version and exit.")] = False,
) -> None:
    """fedlang: federated learning on JAX. Start with `fedlang demo`."""


training.register(app)
data.register(app)
deploy.register(app)
ops.register(app)


def main() -> None:
    """The console-script entry point."""
    app()
