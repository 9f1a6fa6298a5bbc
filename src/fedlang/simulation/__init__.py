"""Client data for simulation: lazy datasets, an on-disk store, readers, partitioners,
client samplers, and the experiment driver with its metrics writers and checkpoints;
the virtual-clock simulation of asynchronous (FedBuff) and synchronous training
(`clock`, `async_sim`: `run_async`, `run_sync`). See docs/data.md and docs/learning.md."""

from fedlang.simulation import async_sim as async_sim
from fedlang.simulation import checkpoint as checkpoint
from fedlang.simulation import clock as clock
from fedlang.simulation import datasets as datasets
from fedlang.simulation import formats as formats
from fedlang.simulation import inspection as inspection
from fedlang.simulation import partitioners as partitioners
from fedlang.simulation import plots as plots
from fedlang.simulation import sampling as sampling
from fedlang.simulation import state_store as state_store
from fedlang.simulation import store as store
from fedlang.simulation import writers as writers
from fedlang.simulation.async_sim import run_async as run_async
from fedlang.simulation.async_sim import run_sync as run_sync
from fedlang.simulation.checkpoint import CheckpointError as CheckpointError
from fedlang.simulation.checkpoint import CheckpointMismatchError as CheckpointMismatchError
from fedlang.simulation.client_data import ClientData as ClientData
from fedlang.simulation.client_data import train_test_client_split as train_test_client_split
from fedlang.simulation.dataset import Dataset as Dataset
from fedlang.simulation.driver import TrainingInterrupted as TrainingInterrupted
from fedlang.simulation.driver import TrainingResult as TrainingResult
from fedlang.simulation.driver import derive_seed as derive_seed
from fedlang.simulation.driver import run_training as run_training
from fedlang.simulation.errors import StoreError as StoreError
from fedlang.simulation.errors import UnknownClientError as UnknownClientError
from fedlang.simulation.formats.arrays import from_numpy as from_numpy
from fedlang.simulation.formats.directory import from_directory as from_directory
from fedlang.simulation.formats.leaf import from_leaf as from_leaf
from fedlang.simulation.formats.sqlite import from_sqlite as from_sqlite
from fedlang.simulation.formats.tabular import from_csv as from_csv
from fedlang.simulation.formats.tabular import from_pandas as from_pandas
from fedlang.simulation.sampling import AvailabilitySampler as AvailabilitySampler
from fedlang.simulation.sampling import UniformSampler as UniformSampler
from fedlang.simulation.sampling import WeightedSampler as WeightedSampler
from fedlang.simulation.specs import StringSpec as StringSpec
from fedlang.simulation.state_store import ClientStateError as ClientStateError
from fedlang.simulation.state_store import ClientStateStore as ClientStateStore
