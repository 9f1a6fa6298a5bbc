"""Readers that turn existing data into `ClientData`, one module per format."""

from fedlang.simulation.formats import tf_example as tf_example
from fedlang.simulation.formats.arrays import from_numpy as from_numpy
from fedlang.simulation.formats.directory import from_directory as from_directory
from fedlang.simulation.formats.leaf import from_leaf as from_leaf
from fedlang.simulation.formats.sqlite import Feature as Feature
from fedlang.simulation.formats.sqlite import from_sqlite as from_sqlite
from fedlang.simulation.formats.sqlite import write_sqlite as write_sqlite
from fedlang.simulation.formats.tabular import from_arrow_table as from_arrow_table
from fedlang.simulation.formats.tabular import from_csv as from_csv
from fedlang.simulation.formats.tabular import from_pandas as from_pandas
