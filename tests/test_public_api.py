"""The public API is exactly what the __init__ files re-export."""

import importlib

import fedlang

PUBLIC = {
    "CLIENTS",
    "SERVER",
    "Computation",
    "FederatedType",
    "FunctionType",
    "SequenceType",
    "SparseTensor",
    "SparseTensorType",
    "StructType",
    "TensorType",
    "Type",
    "federated_aggregate",
    "federated_apply",
    "federated_broadcast",
    "federated_computation",
    "federated_eval",
    "federated_map",
    "federated_max",
    "federated_mean",
    "federated_min",
    "federated_secure_modular_sum",
    "federated_secure_sum_bitwidth",
    "federated_select",
    "federated_sum",
    "federated_sparse_sum",
    "federated_sparse_mean",
    "federated_value",
    "federated_zip",
    "jax_computation",
    "runtime",
    "sequence_map",
    "sequence_reduce",
    "sequence_sum",
    "set_default_context",
    "templates",
    "to_type",
    "serialize_value",
    "deserialize_value",
    "SerializationError",
    "signing",
    "type_at_clients",
    "type_at_server",
    # client state (issue 25)
    "ClientStates",
    "with_client_state",
}


def test_every_public_name_imports_from_its_public_path():
    for name in PUBLIC:
        assert hasattr(fedlang, name), name
    assert importlib.import_module("fedlang.templates").IterativeProcess is not None
    assert importlib.import_module("fedlang.runtime").reference_context is not None


def test_nothing_else_leaks_into_the_top_level():
    exported = {n for n in dir(fedlang) if not n.startswith("_")}
    submodules = {
        "core",
        "backends",
        "simulation",
        "learning",
        "aggregators",
        "analytics",
        "deploy",
        "cli",
    }
    assert exported - submodules <= PUBLIC | {
        "serialize_value",
        "deserialize_value",
        "SerializationError",
    "signing",
    }
