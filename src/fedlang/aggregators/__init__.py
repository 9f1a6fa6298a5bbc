"""Composable aggregation factories (`create(value_type[, weight_type])` -> process).

The base: `SumFactory`, `MeanFactory` (weighted) and `UnweightedMeanFactory`, and the
two factory interfaces other aggregators (DP, secure, robust, compression, sparse)
implement. See docs/learning.md.
"""

from fedlang.aggregators.accounting import PrivacyAccountant as PrivacyAccountant
from fedlang.aggregators.accounting import dp_epsilon as dp_epsilon
from fedlang.aggregators.clipping import clipping_factory as clipping_factory
from fedlang.aggregators.clipping import zeroing_factory as zeroing_factory
from fedlang.aggregators.dp import DifferentiallyPrivateFactory as DifferentiallyPrivateFactory
from fedlang.aggregators.encoding import EncodedSumFactory as EncodedSumFactory
from fedlang.aggregators.encoding import Encoder as Encoder
from fedlang.aggregators.factory import UnweightedAggregationFactory as UnweightedAggregationFactory
from fedlang.aggregators.factory import WeightedAggregationFactory as WeightedAggregationFactory
from fedlang.aggregators.krum import BulyanFactory as BulyanFactory
from fedlang.aggregators.krum import KrumFactory as KrumFactory
from fedlang.aggregators.mean import MeanFactory as MeanFactory
from fedlang.aggregators.mean import UnweightedMeanFactory as UnweightedMeanFactory
from fedlang.aggregators.quantile import QuantileEstimator as QuantileEstimator
from fedlang.aggregators.robust import GeometricMedianFactory as GeometricMedianFactory
from fedlang.aggregators.robust import MedianFactory as MedianFactory
from fedlang.aggregators.robust import TrimmedMeanFactory as TrimmedMeanFactory
from fedlang.aggregators.secure import SecureModularSumFactory as SecureModularSumFactory
from fedlang.aggregators.secure import SecureSumFactory as SecureSumFactory
from fedlang.aggregators.sum import SumFactory as SumFactory
from fedlang.core.processes import AggregationProcess as AggregationProcess
from fedlang.core.processes import MeasuredProcessOutput as MeasuredProcessOutput
