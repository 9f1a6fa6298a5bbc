"""The analytics run on the reference runtime and on the simulation runtime."""

import pytest

import fedlang as fl

RUNTIMES = {
    "reference": lambda: fl.runtime.reference_context(),
    "simulation": lambda: fl.runtime.simulation_context(strategy="scan", decision_cache=False),
}


@pytest.fixture(params=list(RUNTIMES))
def rt(request):
    """Runs the test body's computations on each runtime in turn."""
    with RUNTIMES[request.param]():
        yield request.param
