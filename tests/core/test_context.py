"""Execution contexts: no work at import, the default made on first use, per-thread stacks."""

import subprocess
import sys
import textwrap
import threading

import numpy as np

import fedlang as fl
from fedlang.core import context
from fedlang.runtime import ReferenceContext, SimulationContext


def _run_fresh(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_importing_fedlang_starts_no_backend_and_no_thread():
    out = _run_fresh(
        """
        import sys, threading
        before = threading.active_count()
        import fedlang as fl
        from jax._src import xla_bridge
        print(threading.active_count() - before, len(xla_bridge._backends),
              'pyarrow' in sys.modules, 'keras' in sys.modules, 'fedlang.learning' in sys.modules)
        """
    )
    assert out == "0 0 False False False"


def test_subpackages_are_attributes_right_after_import():
    out = _run_fresh(
        """
        import fedlang as fl
        print(fl.simulation.ClientData.__name__, fl.learning.LearningProcess.__name__,
              fl.aggregators.MeanFactory.__name__, 'simulation' in dir(fl))
        """
    )
    assert out == "ClientData LearningProcess MeanFactory True"


def test_the_default_context_is_made_on_first_use():
    out = _run_fresh(
        """
        import numpy as np, fedlang as fl
        from fedlang.core import context
        made = context._default is None
        @fl.federated_computation(fl.type_at_clients(np.float32))
        def mean(x):
            return fl.federated_mean(x)
        print(made, mean([1.0, 3.0]), type(context.get_default_context()).__name__)
        """
    )
    assert out == "True 2.0 SimulationContext"


@fl.federated_computation(fl.type_at_clients(np.float32))
def _mean(x):
    return fl.federated_mean(x)


def test_two_threads_run_in_two_different_contexts_at_once():
    inside = threading.Barrier(2, timeout=30)
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def work(name, make):
        try:
            ctx = make()
            with context.with_context(ctx):
                inside.wait()  # both threads are inside their contexts now
                seen[name] = context.get_context()
                assert float(_mean([1.0, 2.0, 6.0])) == 3.0
                inside.wait()
                assert context.get_context() is ctx
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=("reference", ReferenceContext)),
        threading.Thread(target=work, args=("simulation", SimulationContext)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert isinstance(seen["reference"], ReferenceContext)
    assert isinstance(seen["simulation"], SimulationContext)
    assert context.current_stack() == ()


def test_a_context_releases_its_threads_on_close():
    data = [[np.float32(i)] * 3 for i in range(4)]

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(np.float32)))
    def total(ds):
        return fl.federated_sum(fl.sequence_sum(ds))

    before = threading.active_count()
    with fl.runtime.simulation_context(chunk_size=2) as ctx:
        assert float(total(data)) == 18.0
        assert ctx._pool is not None  # the staging thread ran
    assert ctx._pool is None
    assert threading.active_count() <= before
