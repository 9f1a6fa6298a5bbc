"""Runs examples/fine_tune_pretrained.py on small settings."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")


def test_pretrain_then_federated_fine_tuning_improves_held_out_loss(capsys, load_script):
    result = load_script("examples/fine_tune_pretrained.py").main(
        rounds=2, pretrain_epochs=3, verbose=True
    )
    out = capsys.readouterr().out
    pretrained_loss = float(out.split("held-out loss ")[1].split()[0])
    assert result["loss"] < pretrained_loss
    assert "generated: 'to be or " in out
