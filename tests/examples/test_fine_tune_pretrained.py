"""Runs examples/fine_tune_pretrained.py on small settings."""

import importlib.util
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "jax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "fine_tune_pretrained.py"


def _load():
    spec = importlib.util.spec_from_file_location("fine_tune_pretrained", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretrain_then_federated_fine_tuning_improves_held_out_loss(capsys):
    result = _load().main(rounds=2, pretrain_epochs=3, verbose=True)
    out = capsys.readouterr().out
    pretrained_loss = float(out.split("held-out loss ")[1].split()[0])
    assert result["loss"] < pretrained_loss
    assert "generated: 'to be or " in out
