import doctest
import importlib

import pytest

import fedlang.simulation as sim

PUBLIC = {
    "AvailabilitySampler", "ClientData", "Dataset", "StoreError", "StringSpec", "UniformSampler",
    "UnknownClientError", "WeightedSampler", "datasets", "formats", "from_csv", "from_directory",
    "from_leaf", "from_numpy", "from_pandas", "from_sqlite", "partitioners", "sampling", "store",
    "train_test_client_split", "CheckpointError", "CheckpointMismatchError", "TrainingInterrupted", "TrainingResult",
    "checkpoint", "derive_seed", "inspection", "plots", "run_training", "writers",
    "async_sim", "clock", "run_async", "run_sync",
    # client state (issue 25)
    "ClientStateError", "ClientStateStore", "state_store",
}


def test_public_names_and_nothing_else():
    exported = {n for n in dir(sim) if not n.startswith("_")}
    # Submodules imported to build the API are attributes too; they are not public.
    internal = {"client_data", "dataset", "specs", "driver", "errors", "metrics"}
    assert exported - internal == PUBLIC
    for name in PUBLIC:
        assert getattr(sim, name) is not None


@pytest.mark.parametrize("module", ["dataset", "client_data", "sampling", "clock"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"fedlang.simulation.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
