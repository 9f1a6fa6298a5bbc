"""The one console and the one way to fail (src/fedlang/cli/console.py)."""

import pytest
import typer

from fedlang.cli import console


def test_fail_prints_one_error_line_and_exits_with_the_status(capsys):
    with pytest.raises(typer.Exit) as exit_:
        console.fail(ValueError("Expected [data] to have x, found none."), 2, "Set x in [data].")
    assert exit_.value.exit_code == 2
    err = capsys.readouterr().err
    # markup-looking text such as a config table is printed as written
    assert " ".join(err.split()) == "Error: Expected [data] to have x, found none. Set x in [data]."
