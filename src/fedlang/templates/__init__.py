"""Process templates: iterative processes driven by a Python loop."""

from fedlang.core.processes import AggregationProcess as AggregationProcess
from fedlang.core.processes import IterativeProcess as IterativeProcess
from fedlang.core.processes import MeasuredProcess as MeasuredProcess
from fedlang.core.processes import MeasuredProcessOutput as MeasuredProcessOutput
