"""with_client_state: what it declares, and what it refuses."""

import numpy as np
import pytest

import fedlang as fl
from fedlang.core import client_state


@fl.jax_computation()
def zero():
    return np.float32(0)


@fl.jax_computation()
def zeros2():
    return np.zeros(2, np.float32)


@fl.federated_computation(fl.type_at_server(np.float32), fl.type_at_clients(np.float32))
def keep(x, states):
    return fl.federated_sum(states), states


def test_the_spec_names_the_state_and_where_it_goes():
    stateful = fl.with_client_state(keep, zero, parameter="states", result=1)
    spec = stateful.client_state
    assert (str(spec.state_type), spec.parameter, spec.result) == ("float32", 1, 1)
    assert stateful.type_signature == keep.type_signature
    assert float(spec.initial_state()) == 0.0
    assert client_state.spec_of(stateful) is spec and client_state.spec_of(keep) is None


def test_misdeclared_state_is_refused_naming_what_differs():
    with pytest.raises(TypeError, match=r"parameter 'x' to be client states.*found float32@SERVER"):
        fl.with_client_state(keep, zero, parameter="x", result=1)
    with pytest.raises(TypeError, match=r"result field 0 to be client states"):
        fl.with_client_state(keep, zero, parameter="states", result=0)
    with pytest.raises(TypeError, match=r"no field 'nope'"):
        fl.with_client_state(keep, zero, parameter="nope", result=1)
    with pytest.raises(TypeError, match=r"initialize to be a computation \( -> float32\)"):
        fl.with_client_state(keep, zeros2, parameter="states", result=1)
    stateful = fl.with_client_state(keep, zero, parameter="states", result=1)
    with pytest.raises(TypeError, match="already declares its client state"):
        fl.with_client_state(stateful, zero, parameter="states", result=1)

    @fl.jax_computation(np.float32)
    def to_pair(s):
        return np.zeros(2, np.float32) + s

    @fl.federated_computation(fl.type_at_clients(np.float32))
    def changes_type(states):
        return fl.federated_sum(states), fl.federated_map(to_pair, states)

    with pytest.raises(TypeError, match="new client states of the type it takes"):
        fl.with_client_state(changes_type, zero, parameter=0, result=1)
