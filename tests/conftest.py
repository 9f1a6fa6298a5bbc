"""Test configuration shared by the whole suite, and the runtime conformance fixture."""

import importlib.util
import os
import pathlib
import types

# Keras must run on JAX; set before anything imports keras.
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import pytest

from fedlang.core import context
from fedlang.runtime import ReferenceContext, SimulationContext

# Implicit dtype promotion hides bugs (float32 * float64 -> float64 silently): forbid it.
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Every runtime runs the same conformance tests and is compared with the reference.
RUNTIMES = {
    "reference": lambda num_clients=None: ReferenceContext(num_clients),
    "simulation": lambda num_clients=None: SimulationContext(num_clients=num_clients),
    "simulation-chunk1-scan": lambda num_clients=None: SimulationContext(
        chunk_size=1, strategy="scan", num_clients=num_clients
    ),
    "simulation-chunk2-loop": lambda num_clients=None: SimulationContext(
        chunk_size=2, strategy="loop", num_clients=num_clients, prefetch=False
    ),
    "simulation-vmap": lambda num_clients=None: SimulationContext(
        chunk_size=5, strategy="vmap", vmap_width=2, num_clients=num_clients
    ),
}


@pytest.fixture(params=list(RUNTIMES))
def runtime(request):
    """Makes each runtime the default in turn; yields a factory `make(num_clients=None)`."""
    make = RUNTIMES[request.param]
    previous = context.get_default_context()
    context.set_default_context(make())
    try:
        yield make
    finally:
        context.set_default_context(previous)


ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def load_script():
    """Imports a script of the repository (an example, a benchmark) by its path, once."""
    loaded: dict[str, types.ModuleType] = {}

    def load(relative_path: str) -> types.ModuleType:
        if relative_path not in loaded:
            path = ROOT / relative_path
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None, f"cannot load {path}"
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded[relative_path] = module
        return loaded[relative_path]

    return load
