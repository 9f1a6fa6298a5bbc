"""Aggregation factories: objects that build `AggregationProcess`es for a value type.

A factory is configuration; `create` specializes it to the type of the values (and
weights) to aggregate. Factories compose by nesting: an outer factory takes inner
factories as arguments and calls the inner processes inside its own `next`, reporting
their state and measurements under its own (as `MeanFactory` does with `SumFactory`).
"""

from __future__ import annotations

import abc
from typing import Any

from fedlang.core import processes, types


class UnweightedAggregationFactory(abc.ABC):
    """Builds an `AggregationProcess` whose `next(state, client_values)` takes no weights."""

    @abc.abstractmethod
    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns a process aggregating `{value_type}@CLIENTS` into `value_type@SERVER`.

        Args:
          value_type: the type of one client's value (anything `fedlang.to_type` accepts).

        Returns:
          An unweighted `AggregationProcess`.
        """


class WeightedAggregationFactory(abc.ABC):
    """Builds an `AggregationProcess` whose `next(state, client_values, client_weights)`."""

    @abc.abstractmethod
    def create(self, value_type: Any, weight_type: Any) -> processes.AggregationProcess:
        """Returns a process aggregating weighted `{value_type}@CLIENTS` at the server.

        Args:
          value_type: the type of one client's value (anything `fedlang.to_type` accepts).
          weight_type: the type of one client's weight, a numeric scalar.

        Returns:
          A weighted `AggregationProcess`.
        """


def check_value_type(value_type: Any, kinds: str = "iuf", what: str = "value") -> types.Type:
    """Converts `value_type` to a local struct-of-tensors type and checks its dtypes.

    Raises:
      TypeError: when the type is federated, a function or sequence, or has a dtype
        outside `kinds` (numpy kind letters).
    """
    t = types.to_type(value_type)
    if types.contains_federated(t):
        raise TypeError(
            f"Expected a local {what} type (the type of one client's value), found {t}. "
            "Pass the member type, e.g. `value_type.member`."
        )
    if not types.is_numeric(t, kinds) or any(
        not isinstance(leaf, types.TensorType) for leaf in types.tensor_leaves(t)
    ):
        raise TypeError(
            f"Expected a {what} type made of dense tensors of kind {kinds!r} "
            f"({'floating' if kinds == 'f' else 'numeric'}), found {t}."
        )
    return t


def check_weight_type(weight_type: Any) -> types.TensorType:
    """Converts `weight_type` and checks it is a numeric scalar tensor type.

    Raises:
      TypeError: when it is not a scalar numeric tensor type.
    """
    t = types.to_type(weight_type)
    if not (isinstance(t, types.TensorType) and t.shape == () and types.is_numeric(t, "iuf")):
        raise TypeError(
            f"Expected a numeric scalar weight type such as float32, found {t}."
        )
    return t
