"""Process templates: iterative processes driven by a Python loop."""

from fedlang.core.templates import IterativeProcess as IterativeProcess
