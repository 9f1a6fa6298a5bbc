"""SCAFFOLD, Ditto and FedPer against plain NumPy, round by round, on the runtime
sample (tests/conftest.py).

Each algorithm runs several rounds with partial participation (so stale client
states matter) with its client states in a `ClientStateStore`, and every server and
client value is compared with a direct NumPy transcription of the paper's algorithm.
"""

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models
from fedlang.simulation import ClientStateStore

pytestmark = pytest.mark.usefixtures("runtime")

SPEC = {"x": (np.float32, [None, 3]), "y": (np.float32, [None])}
W0 = np.array([0.1, -0.2, 0.3], np.float32)
B0 = np.float32(0.05)
N = 5
COHORTS = [["c0", "c1"], ["c2", "c3", "c0"], ["c1", "c4"], ["c0", "c2", "c4"]]


def linear_model():
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.asarray(W0), "b": jnp.asarray(B0)},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda pred, y: jnp.mean((pred - y) ** 2),
        input_spec=SPEC)


def client_batches(cid, round_num):
    """1 to 3 batches of 2 to 5 examples, different per client and round."""
    r = np.random.default_rng(100 * round_num + int(cid[1:]))
    return [{"x": r.normal(size=(n, 3)).astype(np.float32),
             "y": r.normal(size=n).astype(np.float32)}
            for n in r.integers(2, 6, size=int(r.integers(1, 4)))]


def grad(w, b, batch):
    """The gradient of the batch's mean squared error, in float64."""
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    r = x @ w + b - y
    return 2 * x.T @ r / len(y), 2 * r.mean()


def assert_close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=what)


@functools.cache
def scaffold():
    return algorithms.build_scaffold(linear_model, 0.05, 0.7, total_clients=N)


def numpy_scaffold(lr_l=0.05, lr_g=0.7):
    """Algorithm 1 of Karimireddy et al. (2020) with option II, step for step."""
    x = (W0.astype(np.float64), np.float64(B0))
    c = (np.zeros(3), 0.0)
    c_i = {}
    history = []
    for round_num, cohort in enumerate(COHORTS):
        dys, dcs = [], []
        for cid in cohort:
            ci = c_i.get(cid, (np.zeros(3), 0.0))
            y = x
            batches = client_batches(cid, round_num)
            for batch in batches:
                gw, gb = grad(*y, batch)
                y = (y[0] - lr_l * (gw - ci[0] + c[0]), y[1] - lr_l * (gb - ci[1] + c[1]))
            k = len(batches)
            new = tuple(ci[j] - c[j] + (x[j] - y[j]) / (k * lr_l) for j in range(2))
            dys.append(tuple(y[j] - x[j] for j in range(2)))
            dcs.append(tuple(new[j] - ci[j] for j in range(2)))
            c_i[cid] = new
        x = tuple(x[j] + lr_g * np.mean([d[j] for d in dys], axis=0) for j in range(2))
        c = tuple(c[j] + len(cohort) / N * np.mean([d[j] for d in dcs], axis=0) for j in range(2))
        history.append((x, c, dict(c_i)))
    return history


def test_scaffold_equals_the_paper_step_for_step(tmp_path):
    process = scaffold()
    store = ClientStateStore(tmp_path / "c_i", process.client_state)
    state = process.initialize()
    for round_num, ((x, c, c_i), cohort) in enumerate(zip(numpy_scaffold(), COHORTS)):
        data = [client_batches(cid, round_num) for cid in cohort]
        state, metrics, _ = process.next(state, data, store.cohort(cohort))
        weights = process.get_model_weights(state).trainable
        assert_close(weights["w"], x[0], f"x.w after round {round_num}")
        assert_close(weights["b"], x[1], f"x.b after round {round_num}")
        cv = state.client_work["control_variate"]
        assert_close(cv["w"], c[0], f"c.w after round {round_num}")
        assert_close(cv["b"], c[1], f"c.b after round {round_num}")
        assert int(metrics["client_work"]["diagnostics"]["num_clients"]) == len(cohort)
        for cid, (cw, cb) in c_i.items():
            assert_close(store.get(cid)["w"], cw, f"c_{cid}.w after round {round_num}")
            assert_close(store.get(cid)["b"], cb, f"c_{cid}.b after round {round_num}")
    assert not store.has_state("c9")


@functools.cache
def ditto():
    return algorithms.build_ditto(linear_model, optax.sgd(0.1), lam=0.5,
                                  personal_optimizer=optax.sgd(0.05))


def numpy_ditto(lr=0.1, lr_p=0.05, lam=0.5):
    """Algorithm 1 of Li et al. (2021): FedAvg (weighted by examples) for w, and
    v_k <- v_k - lr_p (grad F_k(v_k) + lam (v_k - w^t)) on the same batches."""
    w = (W0.astype(np.float64), np.float64(B0))
    v = {}
    history = []
    for round_num, cohort in enumerate(COHORTS):
        deltas, sizes, losses = [], [], []
        for cid in cohort:
            wk, vk = w, v.get(cid, w_initial())
            for batch in client_batches(cid, round_num):
                gw, gb = grad(*wk, batch)
                pw, pb = grad(*vk, batch)
                x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
                losses.append((np.mean((x @ vk[0] + vk[1] - y) ** 2), len(y)))
                wk = (wk[0] - lr * gw, wk[1] - lr * gb)
                vk = (vk[0] - lr_p * (pw + lam * (vk[0] - w[0])),
                      vk[1] - lr_p * (pb + lam * (vk[1] - w[1])))
            v[cid] = vk
            deltas.append(wk)
            sizes.append(sum(len(b["y"]) for b in client_batches(cid, round_num)))
        share = np.asarray(sizes, np.float64) / sum(sizes)
        w = tuple(sum(s * d[j] for s, d in zip(share, deltas)) for j in range(2))
        personal_loss = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
        history.append((w, dict(v), personal_loss))
    return history


def w_initial():
    return (W0.astype(np.float64), np.float64(B0))


def test_ditto_equals_the_paper_step_for_step_and_reports_personalized_metrics(tmp_path):
    process = ditto()
    store = ClientStateStore(tmp_path / "personal", process.client_state)
    state = process.initialize()
    for round_num, ((w, v, personal_loss), cohort) in enumerate(zip(numpy_ditto(), COHORTS)):
        data = [client_batches(cid, round_num) for cid in cohort]
        state, metrics, _ = process.next(state, data, store.cohort(cohort))
        weights = process.get_model_weights(state).trainable
        assert_close(weights["w"], w[0], f"w after round {round_num}")
        assert_close(weights["b"], w[1], f"b after round {round_num}")
        for cid, (vw, vb) in v.items():
            personal = store.get(cid).trainable
            assert_close(personal["w"], vw, f"v_{cid}.w after round {round_num}")
            assert_close(personal["b"], vb, f"v_{cid}.b after round {round_num}")
        assert_close(metrics["client_work"]["personal"]["loss"], personal_loss, "personal loss")

    # personalized evaluation: each client's own model on its held-out data
    evaluate = algorithms.build_ditto_eval(linear_model)
    clients = ["c0", "c3", "c9"]  # c9 was never trained: its personal model is w^0
    held_out = [client_batches(cid, 99) for cid in clients]
    got = evaluate(process.get_model_weights(state), store.cohort(clients), held_out)
    final_w, final_v, _ = numpy_ditto()[-1]
    for which, params in (("global", {c: final_w for c in clients}),
                          ("personal", {c: final_v.get(c, w_initial()) for c in clients})):
        sq = [(b["x"] @ params[c][0] + params[c][1] - b["y"]) ** 2
              for c, batches in zip(clients, held_out) for b in batches]
        assert_close(got[which]["loss"], np.concatenate(sq).mean(), f"{which} eval loss")
    assert store.version == len(COHORTS)  # evaluation reads the store, never writes it


HIDDEN0 = {"kernel": np.linspace(-0.4, 0.4, 12, dtype=np.float32).reshape(3, 4),
           "bias": np.array([0.1, 0.0, -0.1, 0.2], np.float32)}
HEAD0 = {"kernel": np.array([0.3, -0.2, 0.1, 0.4], np.float32), "bias": np.float32(-0.05)}


def two_layer_model():
    def apply(p, x):
        h = jnp.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
        return h @ p["head"]["kernel"] + p["head"]["bias"]

    return models.FunctionalModel(
        init_fn=lambda rng: {"hidden": {k: jnp.asarray(v) for k, v in HIDDEN0.items()},
                             "head": {k: jnp.asarray(v) for k, v in HEAD0.items()}},
        apply_fn=apply, loss_fn=lambda pred, y: jnp.mean((pred - y) ** 2), input_spec=SPEC)


def two_layer_grad(p, batch):
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    h = np.tanh(x @ p["K1"] + p["b1"])
    d = 2 * (h @ p["k2"] + p["b2"] - y) / len(y)
    dh = np.outer(d, p["k2"]) * (1 - h**2)
    return {"K1": x.T @ dh, "b1": dh.sum(0), "k2": h.T @ d, "b2": d.sum()}


def numpy_fed_per(lr=0.1):
    """FedPer: FedAvg (weighted by examples) of the base layers; each client trains
    base and head together and keeps its head."""
    shared = {"K1": HIDDEN0["kernel"].astype(np.float64), "b1": HIDDEN0["bias"].astype(np.float64)}
    head0 = {"k2": HEAD0["kernel"].astype(np.float64), "b2": np.float64(HEAD0["bias"])}
    heads = {}
    history = []
    for round_num, cohort in enumerate(COHORTS):
        trained, sizes = [], []
        for cid in cohort:
            p = {**shared, **heads.get(cid, head0)}
            for batch in client_batches(cid, round_num):
                g = two_layer_grad(p, batch)
                p = {k: p[k] - lr * g[k] for k in p}
            heads[cid] = {"k2": p["k2"], "b2": p["b2"]}
            trained.append(p)
            sizes.append(sum(len(b["y"]) for b in client_batches(cid, round_num)))
        share = np.asarray(sizes, np.float64) / sum(sizes)
        shared = {k: sum(s * t[k] for s, t in zip(share, trained)) for k in shared}
        history.append((shared, dict(heads)))
    return history


@functools.cache
def fed_avg_traffic():
    """FedAvg's per-client traffic on the same model (the whole model both ways)."""
    fedavg = algorithms.build_weighted_fed_avg(two_layer_model, optax.sgd(0.1))
    return fedavg.next(fedavg.initialize(), [client_batches("c0", 0)]).metrics["traffic"]


@functools.cache
def fed_per():
    return algorithms.build_fed_per(two_layer_model, optax.sgd(0.1), local_layers=["head"])


def test_fed_per_averages_the_shared_layers_and_keeps_each_client_s_head(tmp_path):
    process = fed_per()
    store = ClientStateStore(tmp_path / "heads", process.client_state)
    state = process.initialize()
    for round_num, ((shared, heads), cohort) in enumerate(zip(numpy_fed_per(), COHORTS)):
        data = [client_batches(cid, round_num) for cid in cohort]
        state, metrics, _ = process.next(state, data, store.cohort(cohort))
        hidden = process.get_model_weights(state).trainable["hidden"]
        assert_close(hidden["kernel"], shared["K1"], f"shared kernel after round {round_num}")
        assert_close(hidden["bias"], shared["b1"], f"shared bias after round {round_num}")
        for cid, head in heads.items():
            bias, kernel = store.get(cid)  # local leaves in flattening order: head/bias, head/kernel
            assert_close(kernel, head["k2"], f"head of {cid} after round {round_num}")
            assert_close(bias, head["b2"], f"head bias of {cid} after round {round_num}")
    # the server never trains, broadcasts or aggregates the heads
    server_head = process.get_model_weights(state).trainable["head"]
    np.testing.assert_array_equal(server_head["kernel"], HEAD0["kernel"])
    head_bits = 32 * (HEAD0["kernel"].size + 1)
    for kind in ("broadcast_bits", "aggregated_bits"):
        per_client = metrics["traffic"][kind] / len(COHORTS[-1])
        assert per_client == fed_avg_traffic()[kind] - head_bits, kind

    evaluate = algorithms.build_fed_per_eval(two_layer_model, ["head"])
    clients = ["c1", "c4", "c7"]  # c7 never trained: the initial head
    held_out = [client_batches(cid, 99) for cid in clients]
    got = evaluate(process.get_model_weights(state), store.cohort(clients), held_out)
    final_shared, final_heads = numpy_fed_per()[-1]
    sq = []
    for cid, batches in zip(clients, held_out):
        head = final_heads.get(cid, {"k2": HEAD0["kernel"], "b2": HEAD0["bias"]})
        for b in batches:
            h = np.tanh(b["x"] @ final_shared["K1"] + final_shared["b1"])
            sq.append((h @ head["k2"] + head["b2"] - b["y"]) ** 2)
    assert_close(got["loss"], np.concatenate(sq).mean(), "personalized eval loss")
