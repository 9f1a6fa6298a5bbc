"""Fine-tuning a pretrained model with federated learning (TFF's tutorial 2, small).

A small character model (embedding -> dense -> next-character logits) is first trained
centrally with Keras on public text. Its weights start a FedAvg process, which
fine-tunes it on client text read from a CSV file (one client per speaker), with a
centralized evaluation on held-out text between rounds. The trained weights are then
copied back into the Keras model, which generates text.

Run it with `python examples/fine_tune_pretrained.py`.
"""

from __future__ import annotations

import csv
import os
import pathlib
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np
import optax

import fedlang.simulation as sim
from fedlang.learning import algorithms, evaluation, models

SEQ = 12
VOCAB = sorted(set(" abcdefghijklmnopqrstuvwxyz.,!?'"))
CHAR_TO_ID = {c: i + 1 for i, c in enumerate(VOCAB)}  # 0 pads
ID_TO_CHAR = {i: c for c, i in CHAR_TO_ID.items()}
INPUT_SPEC = {"x": (np.int32, [None, SEQ]), "y": (np.int32, [None, SEQ])}

PUBLIC_TEXT = "to be, or not to be, that is the question. whether tis nobler in the mind to suffer. "
SPEAKERS = {
    "hamlet": ["o that this too too solid flesh would melt", "the rest is silence, the rest is silence",
               "to be or not to be, to sleep perchance to dream"],
    "ophelia": ["there is rosemary, that is for remembrance", "o what a noble mind is here overthrown",
                "pray you love, remember, there is pansies"],
    "horatio": ["now cracks a noble heart, good night sweet prince", "so have i heard and do in part believe it",
                "a piece of him, a piece of him is here"],
}


def encode(text: str) -> np.ndarray:
    return np.array([CHAR_TO_ID.get(c, CHAR_TO_ID[" "]) for c in text.lower()], np.int32)


def windows(text: str) -> dict[str, np.ndarray]:
    """Every (SEQ chars -> next SEQ chars) window of a text."""
    ids = encode(text)
    starts = range(0, max(len(ids) - SEQ, 1), 3)
    x = np.stack([np.pad(ids[s : s + SEQ], (0, max(0, SEQ - len(ids[s : s + SEQ])))) for s in starts])
    y = np.stack([np.pad(ids[s + 1 : s + SEQ + 1], (0, max(0, SEQ - len(ids[s + 1 : s + SEQ + 1]))))
                  for s in starts])
    return {"x": x, "y": y}


def create_keras_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((SEQ,), dtype="int32"),
        keras.layers.Embedding(len(VOCAB) + 1, 16),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(len(VOCAB) + 1),
    ])


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def write_client_csv(directory: pathlib.Path) -> pathlib.Path:
    """The clients' text: one row per line spoken, `speaker,text`."""
    path = directory / "lines.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["speaker", "text"])
        for speaker, lines in SPEAKERS.items():
            for line in lines:
                writer.writerow([speaker, line])
    return path


def generate(keras_model: keras.Model, start: str, length: int = 30) -> str:
    text = start
    for _ in range(length):
        ids = encode(text[-SEQ:])
        ids = np.pad(ids, (SEQ - len(ids), 0))[None]
        logits = np.asarray(keras_model(ids))[0, -1]
        text += ID_TO_CHAR.get(int(np.argmax(logits[1:])) + 1, " ")
    return text


def main(rounds: int = 5, pretrain_epochs: int = 20, verbose: bool = True) -> dict[str, float]:
    """Pretrains, fine-tunes federatedly, generates; returns the final held-out metrics."""
    keras.utils.set_random_seed(0)
    pretrained = create_keras_model()
    pretrained.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
    public = windows(PUBLIC_TEXT * 4)
    pretrained.fit(public["x"], public["y"], epochs=pretrain_epochs, batch_size=16, verbose=0)

    with tempfile.TemporaryDirectory() as tmp:
        clients = sim.from_csv(write_client_csv(pathlib.Path(tmp)), client_id_column="speaker")
        # Text is mapped to token windows per client, then batched.
        clients = clients.preprocess(
            lambda ds: sim.Dataset.from_tensor_slices(
                windows(" ".join(str(e["text"]) for e in ds))).batch(8))
        client_datasets = [clients.create_dataset_for_client(c) for c in clients.client_ids]
        held_out = [windows(" ".join(lines[-1] for lines in SPEAKERS.values()))]

        def model_fn() -> models.Model:
            return models.from_keras_model(
                create_keras_model(), loss(), INPUT_SPEC,
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])

        process = algorithms.build_weighted_fed_avg(model_fn, client_optimizer=optax.sgd(0.5))
        state = process.set_model_weights(process.initialize(), models.weights_from_keras_model(pretrained))
        evaluate = evaluation.build_centralized_evaluation(model_fn)
        result = evaluate(process.get_model_weights(state), held_out)
        if verbose:
            print(f"pretrained: held-out loss {float(result['loss']):.3f}  "
                  f"accuracy {float(result['accuracy']):.3f}")
        for round_num in range(rounds):
            state, metrics = process.next(state, client_datasets)
            result = evaluate(process.get_model_weights(state), held_out)
            if verbose:
                print(f"round {round_num + 1}: train loss {float(metrics['client_work']['train']['loss']):.3f}"
                      f"  held-out loss {float(result['loss']):.3f}  accuracy {float(result['accuracy']):.3f}")

    models.assign_weights_to_keras_model(pretrained, process.get_model_weights(state))
    if verbose:
        print("generated:", repr(generate(pretrained, "to be or ")))
    return {k: float(v) for k, v in result.items()}


if __name__ == "__main__":
    main()
