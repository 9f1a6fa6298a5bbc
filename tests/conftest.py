"""Test configuration shared by the whole suite, and the runtime conformance fixture."""

import importlib.util
import os
import pathlib
import shutil
import tempfile
import types
import warnings
import zlib

# Keras must run on JAX; set before anything imports keras.
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import pytest

from fedlang.core import context
from fedlang.runtime import RayContext, ReferenceContext, SimulationContext

# One compilation cache on disk for the whole run: the suite builds the same processes
# again and again (each test its own, each CLI test in its own `fedlang` process, each
# pytest-xdist worker its own), and a program compiled once is read back, not compiled
# again. The first process to load this file (the run, or its xdist controller) makes
# the directory; workers and subprocesses inherit it through the environment and
# `pytest_unconfigure` removes it at the end. A size limit turns on JAX's file lock
# around each entry's read and write: without it an entry is written in place, and a
# process or thread reading it meanwhile reads half of it (JAX warns, which the suite
# makes an error).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedlang-jax-cache-")
# (Programs that compile in under 0.1 s are left out: reading them back saves nothing.)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_compilation_cache_max_size",
                  int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
# The size limit is there for the lock, not for eviction (a run writes well under 8 GiB),
# but with it every write lists the whole directory to find what to evict, so each
# entry makes every later write slower. This process skips that listing (JAX's private
# LRUCache; if it is gone, writes are only slower). Subprocesses keep it: they write
# few entries.
try:
    from jax._src import lru_cache as _lru_cache

    _lru_cache.LRUCache._evict_if_needed = lambda self, *, additional_size=0: None
except (ImportError, AttributeError):
    pass

# Implicit dtype promotion hides bugs (float32 * float64 -> float64 silently): forbid it.
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Float32 matrix products in full precision on every device (GPUs may use TF32 by
# default), so runtimes that order their arithmetic differently (a vmap, a loop)
# agree within the tests' tolerances on a GPU as on a CPU.
jax.config.update("jax_default_matmul_precision", "highest")

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
    # Two actors on the session's local Ray instance (`ray_session`), small chunks and
    # tasks, so a wave has several tasks and its partials meet in a merge tree.
    "ray": lambda num_clients=None: RayContext(
        chunk_size=2, num_workers=2, tasks_per_worker=2, num_clients=num_clients
    ),
}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance (2 CPUs) for the whole test session, started on first use."""
    ray = pytest.importorskip("ray")
    from fedlang.runtime import ray_runtime

    with warnings.catch_warnings():
        # Ray starts its processes with fork + exec; JAX, already running, warns of forks.
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray_runtime.close_pools()
        ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _decision_cache_in_tmp(tmp_path_factory):
    """'auto' remembers decisions on disk: tests keep that file out of the home directory."""
    previous = os.environ.get("FEDLANG_CACHE_DIR")
    os.environ["FEDLANG_CACHE_DIR"] = str(tmp_path_factory.mktemp("fedlang-cache"))
    yield
    if previous is None:
        os.environ.pop("FEDLANG_CACHE_DIR", None)
    else:
        os.environ["FEDLANG_CACHE_DIR"] = previous


def pytest_unconfigure(config):
    """Removes the compilation cache this process made (the run's or xdist controller's)."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The configurations every test of a learning algorithm or an aggregator runs on: its
# subject is the same math on every runtime, and the intrinsics it is built of are
# checked on all six configurations by tests/core, tests/runtime and tests/backends. So
# it runs on the reference, the default simulation, and one of the four others, picked
# by the test's name (each of them gets a share of the tests, and so every algorithm
# file meets several). `pytest.mark.every_runtime` puts a test there back on all six.
SAMPLED_DIRS = ("learning", "aggregators")
ALWAYS = ("reference", "simulation")


def pytest_generate_tests(metafunc):
    """Parametrizes `runtime`: every configuration, or the sample (see `SAMPLED_DIRS`)."""
    if "runtime" not in metafunc.fixturenames:
        return
    names = list(RUNTIMES)
    test_dir = pathlib.Path(metafunc.definition.path).relative_to(ROOT / "tests").parts[0]
    if test_dir in SAMPLED_DIRS and not metafunc.definition.get_closest_marker("every_runtime"):
        others = [name for name in RUNTIMES if name not in ALWAYS]
        pick = zlib.crc32(metafunc.definition.originalname.encode()) % len(others)
        names = [*ALWAYS, others[pick]]
    metafunc.parametrize("runtime", names, indirect=True)


@pytest.fixture
def runtime(request):
    """Makes each runtime the default in turn; yields a factory `make(num_clients=None)`."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
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
