"""Process templates: iterative processes driven by a Python loop."""

from fedlang.core.templates import AggregationProcess as AggregationProcess
from fedlang.core.templates import IterativeProcess as IterativeProcess
from fedlang.core.templates import MeasuredProcess as MeasuredProcess
from fedlang.core.templates import MeasuredProcessOutput as MeasuredProcessOutput
