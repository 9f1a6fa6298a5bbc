"""The composer checks parts against their neighbours; non-trainable weights are a part;
every round reports its traffic."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import aggregators
from fedlang.learning import (
    client_works,
    composers,
    distributors,
    finalizers,
    non_trainable,
    traffic,
)
from fedlang.learning.algorithms import common
from fedlang.learning.models import model as model_lib

SPEC = {"x": (np.float32, [None, 2]), "y": (np.int32, [None])}
DATA = [[{"x": np.ones([2, 2], np.float32), "y": np.array([0, 1], np.int32)}] * 3,
        [{"x": np.ones([2, 2], np.float32), "y": np.array([1, 1], np.int32)}]]


class Counting(model_lib.Model):
    """A linear model whose non-trainable weight counts the batches it trained on."""

    input_spec = model_lib.check_input_spec(SPEC)
    metrics = ()

    def __init__(self, fields=("w",)):
        self.fields = fields

    def initial_weights(self, rng):
        return model_lib.ModelWeights({f: jnp.zeros([2, 2]) for f in self.fields},
                                      {"seen": jnp.float32(0)})

    def apply(self, weights, x, training):
        seen = weights.non_trainable["seen"] + (1.0 if training else 0.0)
        return x @ weights.trainable["w"], {"seen": seen}

    def loss(self, predictions, y, mask=None):
        return model_lib.masked_mean_loss(
            lambda p, t: optax.softmax_cross_entropy_with_integer_labels(p, t).mean(),
            predictions, y, mask)


def _parts(model, update_type=None):
    init = common.initial_weights_fn(model)
    weights_t = init.type_signature.result
    work = client_works.build_model_delta_client_work(model, optax.sgd(0.1))
    aggregator = aggregators.MeanFactory().create(update_type or weights_t["trainable"], np.float32)
    return (init, distributors.build_broadcast_process(weights_t), work, aggregator,
            finalizers.build_apply_optimizer_finalizer(optax.sgd(1.0), weights_t))


def test_a_miswired_part_is_named_with_only_the_differing_fields():
    # arrange: a 12-tensor model whose aggregator was made for another 'w'
    fields = (*(f"layer_{i:02d}" for i in range(11)), "w")
    model = Counting(fields)
    wrong = {f: (np.float32, [2, 2]) for f in fields} | {"w": (np.float32, [2, 3])}
    # act / assert
    with pytest.raises(TypeError) as e:
        composers.compose_learning_process(*_parts(model, update_type=wrong))
    message = str(e.value)
    assert message.startswith(
        "Expected model_update_aggregator's value type to accept client_work's update")
    assert "w: expected float32[2,3], found float32[2,2]" in message
    assert "layer_00" not in message  # only what differs, not two long types
    assert "factory.create(update_type" in message


def test_non_trainable_weights_are_a_replaceable_part():
    model = Counting()
    init, dist, work, agg, fin = _parts(model)
    weights_t = init.type_signature.result
    nt_t = work.next.type_signature.result["result"].member["non_trainable"]
    averaged = composers.compose_learning_process(init, dist, work, agg, fin)
    kept = composers.compose_learning_process(
        init, dist, work, agg, fin, non_trainable.build_keep_server_update(weights_t, nt_t))
    a, metrics = averaged.next(averaged.initialize(), DATA)
    b, _ = kept.next(kept.initialize(), DATA)
    # clients trained on 3 and 1 batches, weighted by 6 and 2 examples
    assert float(averaged.get_model_weights(a).non_trainable["seen"]) == (3 * 6 + 1 * 2) / 8
    assert float(kept.get_model_weights(b).non_trainable["seen"]) == 0.0
    # traffic: the per-client bits of the round, times the clients
    per_client = traffic.per_client_bits(averaged.next)
    assert int(metrics["traffic"]["num_clients"]) == 2
    assert float(metrics["traffic"]["broadcast_bits"]) == 2 * per_client.broadcast_bits
    assert float(metrics["traffic"]["aggregated_bits"]) == 2 * per_client.aggregated_bits


def test_traffic_is_read_off_the_types_of_the_intrinsics():
    @fl.federated_computation(fl.type_at_server((np.float32, [3])),
                              fl.type_at_clients((np.float32, [2])), fl.type_at_clients(np.int32))
    def round_fn(model, values, counts):
        sent = fl.federated_broadcast(model)  # 3 floats down
        del sent
        return fl.federated_sum(counts), fl.federated_mean(values)  # 1 int + 2 floats up

    assert traffic.per_client_bits(round_fn) == traffic.Traffic(96, 96, ())
    assert traffic.type_bits(fl.to_type((np.float32, [None, 3]))) is None
