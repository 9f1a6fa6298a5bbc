"""Computes TFF 0.87's results on small deterministic inputs; writes tff_reference.json.

Not run by CI (it needs TensorFlow Federated 0.87, which fedlang does not depend on):
see README.md in this folder for how it was run. The tests in
tests/learning/test_fed_kmeans.py, test_reconstruction.py and test_personalization.py
run fedlang on the inputs stored in the JSON file and compare with TFF's outputs.

Run: python make_reference.py [output.json]
"""

import collections
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.learning.models import reconstruction_model

OUT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).with_name(
    "tff_reference.json"))


def listify(x):
    """NumPy / TF values as JSON lists (float32 values printed exactly as float64)."""
    if isinstance(x, dict | collections.OrderedDict):
        return {k: listify(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [listify(v) for v in x]
    a = np.asarray(x)
    if a.dtype.kind == "f":
        return a.astype(np.float64).tolist()
    return a.tolist()


# --- k-means: tff.learning.algorithms.build_fed_kmeans -----------------------------------


def kmeans_reference():
    rng = np.random.default_rng(0)
    out = {}
    # A: centroids initialized from the seed, two rounds on random points.
    process = tff.learning.algorithms.build_fed_kmeans(3, (2,), random_seed=(5, 7))
    state = process.initialize()
    clients = [rng.normal(size=(n, 2)).astype(np.float32) * 2 for n in (5, 8, 3)]
    rounds = []
    initial = process.get_model_weights(state)
    for _ in range(2):
        data = [tf.data.Dataset.from_tensor_slices(c) for c in clients]
        output = process.next(state, data)
        state = output.state
        rounds.append({
            "centroids": process.get_model_weights(state),
            "cluster_weights": state.finalizer,
            "num_examples": output.metrics["client_work"]["num_examples"],
        })
    out["seeded"] = {"num_clusters": 3, "data_shape": [2], "random_seed": [5, 7],
                     "initial_centroids": initial, "clients": clients, "rounds": rounds}
    # Seeds of other shapes and sizes: the initial centroids alone.
    out["seeds"] = [
        {"num_clusters": k, "data_shape": list(shape), "random_seed": list(seed),
         "initial_centroids": tff.learning.algorithms.build_fed_kmeans(
             k, shape, random_seed=seed).get_model_weights(
                 tff.learning.algorithms.build_fed_kmeans(k, shape, random_seed=seed).initialize())}
        for k, shape, seed in [(4, (3, 2), (123456789012, 0)), (5, (1,), (1, 2**40)),
                               (2, (7,), (0, 0))]
    ]
    # B: hand-set centroids; a point exactly between centroids 0 and 1 (a tie: the lower
    # index wins), a cluster no point reaches (its centroid and weight stay), and points
    # at several distances.
    process = tff.learning.algorithms.build_fed_kmeans(3, (2,), random_seed=(1, 1))
    state = process.initialize()
    centroids = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 50.0]], np.float32)
    state = process.set_model_weights(state, centroids)
    clients = [
        np.array([[1.0, 0.0], [0.5, 0.5], [3.0, 0.0]], np.float32),
        np.array([[2.5, -1.0], [-1.0, -1.0]], np.float32),
        np.array([[1.0, 0.0]], np.float32),
    ]
    rounds = []
    for _ in range(2):
        data = [tf.data.Dataset.from_tensor_slices(c) for c in clients]
        output = process.next(state, data)
        state = output.state
        rounds.append({
            "centroids": process.get_model_weights(state),
            "cluster_weights": state.finalizer,
            "num_examples": output.metrics["client_work"]["num_examples"],
        })
    out["hand_set"] = {"num_clusters": 3, "data_shape": [2], "centroids": centroids,
                       "clients": clients, "rounds": rounds}
    return out


# --- reconstruction: build_fed_recon, build_fed_recon_eval -------------------------------

W0 = np.linspace(-0.5, 0.5, 9, dtype=np.float32).reshape(3, 3)
B0 = np.array([0.1, -0.2, 0.05], np.float32)
U0 = np.array([0.0, 0.3, -0.1], np.float32)
RECON_SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 3], tf.float32), y=tf.TensorSpec([None], tf.int32))


class LinearWithUserBias(tff.learning.models.ReconstructionModel):
    """logits = x @ w + b (global) + u (local: one bias per user, reconstructed)."""

    def __init__(self):
        self._w = tf.Variable(W0, name="w")
        self._b = tf.Variable(B0, name="b")
        self._u = tf.Variable(U0, name="u")

    @property
    def global_trainable_variables(self):
        return [self._b, self._w]  # fedlang's dict order: sorted keys

    @property
    def global_non_trainable_variables(self):
        return []

    @property
    def local_trainable_variables(self):
        return [self._u]

    @property
    def local_non_trainable_variables(self):
        return []

    @property
    def input_spec(self):
        return RECON_SPEC

    @tf.function
    def forward_pass(self, batch_input, training=True):
        del training
        logits = batch_input["x"] @ self._w + self._b + self._u
        return reconstruction_model.ReconstructionBatchOutput(
            predictions=logits, labels=batch_input["y"],
            num_examples=tf.shape(batch_input["x"])[0])


def recon_loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def recon_metrics():
    return [tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def batches(rng, sizes):
    return [{"x": rng.normal(size=(n, 3)).astype(np.float32),
             "y": rng.integers(0, 3, n).astype(np.int32)} for n in sizes]


def as_dataset(client_batches):
    """The client's batches (all of one size) as a batched dataset (no Python generator:
    TFF's executor cannot run one)."""
    size = len(client_batches[0]["y"])
    assert all(len(b["y"]) == size for b in client_batches)
    whole = {k: np.concatenate([b[k] for b in client_batches]) for k in ("x", "y")}
    return tf.data.Dataset.from_tensor_slices(whole).batch(size)


def global_weights(weights):
    return {"b": weights.trainable[0], "w": weights.trainable[1]}


def recon_reference():
    rng = np.random.default_rng(1)
    # Equal batch sizes (3): TFF's loss (a mean of batch means) is then the example mean.
    clients = [batches(rng, [3] * 4), batches(rng, [3] * 5), batches(rng, [3] * 2)]
    sgd = tff.learning.optimizers.build_sgdm
    cases = {
        "default": {},
        "uniform_epochs": {
            "client_weighting": tff.learning.ClientWeighting.UNIFORM,
            "dataset_split_fn": tff.learning.models.ReconstructionModel.build_dataset_split_fn(
                recon_epochs=2, recon_steps_max=3, post_recon_epochs=2,
                post_recon_steps_max=3, split_dataset=False),
        },
    }
    out = {"clients": clients, "initial": {"w": W0, "b": B0, "u": U0}, "cases": {}}
    for name, kwargs in cases.items():
        process = tff.learning.algorithms.build_fed_recon(
            LinearWithUserBias, loss_fn=recon_loss, metrics_fn=recon_metrics,
            server_optimizer_fn=sgd(learning_rate=1.0), client_optimizer_fn=sgd(learning_rate=0.5),
            reconstruction_optimizer_fn=sgd(learning_rate=0.3), **kwargs)
        state = process.initialize()
        rounds = []
        for _ in range(2):
            output = process.next(state, [as_dataset(c) for c in clients])
            state = output.state
            rounds.append({"weights": global_weights(process.get_model_weights(state)),
                           "train": output.metrics["client_work"]["train"]})
        evaluator = tff.learning.algorithms.build_fed_recon_eval(
            LinearWithUserBias, loss_fn=recon_loss, metrics_fn=recon_metrics,
            reconstruction_optimizer_fn=sgd(learning_rate=0.3),
            **{k: v for k, v in kwargs.items() if k == "dataset_split_fn"})
        eval_state = evaluator.set_model_weights(evaluator.initialize(),
                                                 process.get_model_weights(state))
        eval_out = evaluator.next(eval_state, [as_dataset(c) for c in clients])
        out["cases"][name] = {
            "rounds": rounds,
            "eval": eval_out.metrics["client_work"]["eval"]["current_round_metrics"],
        }
    return out


# --- personalization evaluation: build_personalization_eval_computation -----------------

P_W0 = np.array([[0.2, -0.1, 0.0], [0.05, 0.3, -0.2], [-0.3, 0.1, 0.25]], np.float32)
P_B0 = np.array([0.0, 0.1, -0.1], np.float32)
P_SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 3], tf.float32), y=tf.TensorSpec([None], tf.int32))


def p13n_model_fn():
    keras_model = tf.keras.Sequential([tf.keras.layers.Dense(
        3, input_shape=(3,), kernel_initializer=tf.keras.initializers.Constant(P_W0),
        bias_initializer=tf.keras.initializers.Constant(P_B0))])
    return tff.learning.models.from_keras_model(
        keras_model, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        input_spec=P_SPEC, metrics=[tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")])


@tf.function
def evaluate_fn(model, dataset, batch_size=2):
    """The model's metrics (example-weighted loss, accuracy, counts) on `dataset`."""
    for var in model.local_variables:
        var.assign(tf.zeros_like(var))

    def step(state, batch):
        model.forward_pass(batch, training=False)
        return state

    dataset.batch(batch_size).reduce(tf.constant(0), step)
    m = model.report_local_unfinalized_metrics()
    return collections.OrderedDict(
        loss=m["loss"][0] / m["loss"][1], accuracy=m["accuracy"][0] / m["accuracy"][1],
        num_examples=m["num_examples"][0], num_batches=m["num_batches"][0])


def build_finetune(learning_rate, batch_size, num_epochs):
    def builder():
        optimizer = tf.keras.optimizers.SGD(learning_rate=learning_rate)

        @tf.function
        def personalize_fn(model, train_data, test_data):
            def train_step(count, batch):
                with tf.GradientTape() as tape:
                    output = model.forward_pass(batch)
                grads = tape.gradient(output.loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return count + output.num_examples

            train_data.batch(batch_size).repeat(num_epochs).reduce(tf.constant(0), train_step)
            return evaluate_fn(model, test_data)

        return personalize_fn

    return builder


def p13n_reference():
    rng = np.random.default_rng(2)
    batch_size = 2
    sizes = [(5, 4), (3, 6), (8, 3)]  # (train, test) examples per client
    clients = [{"train": batches(rng, [n])[0], "test": batches(rng, [m])[0]} for n, m in sizes]
    strategies = collections.OrderedDict(
        sgd_1_epoch=build_finetune(0.5, batch_size, 1),
        sgd_3_epochs=build_finetune(0.2, batch_size, 3))
    comp = tff.learning.algorithms.build_personalization_eval_computation(
        p13n_model_fn, strategies, evaluate_fn, max_num_clients=10)
    weights = tff.learning.models.ModelWeights(trainable=[P_W0, P_B0], non_trainable=[])
    inputs = [collections.OrderedDict(
        train_data=tf.data.Dataset.from_tensor_slices(c["train"]),
        test_data=tf.data.Dataset.from_tensor_slices(c["test"])) for c in clients]
    metrics = comp(weights, inputs)
    return {"batch_size": batch_size, "initial": {"kernel": P_W0, "bias": P_B0},
            "strategies": {"sgd_1_epoch": {"learning_rate": 0.5, "num_epochs": 1},
                           "sgd_3_epochs": {"learning_rate": 0.2, "num_epochs": 3}},
            "clients": clients, "metrics": metrics}


def main():
    result = {
        "tff_version": tff.__version__,
        "tensorflow_version": tf.__version__,
        "fed_kmeans": kmeans_reference(),
        "fed_recon": recon_reference(),
        "personalization_eval": p13n_reference(),
    }
    OUT.write_text(json.dumps(listify(result), indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    try:
        main()
    finally:
        # TFF's local execution context starts worker processes that outlive the script.
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.terminate()
