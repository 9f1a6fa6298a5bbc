"""Federated analytics: statistics, histograms, quantiles, heavy hitters, count distinct.

Everything here is written as federated computations on the core (`jax_computation`s
inside `federated_computation`s), so it runs on every runtime. Each analytic has a
`build_*` function returning the computation and a function that runs it in the
current runtime on plain per-client data. DP and secure aggregation go through the
aggregators' factories (`Privacy`); the privacy spent is reported as `(epsilon, delta)`
from the aggregators' accountant. See docs/analytics.md.
"""

from fedlang.analytics import data as data
from fedlang.analytics import trie as trie
from fedlang.analytics.count_distinct import build_count_distinct as build_count_distinct
from fedlang.analytics.count_distinct import count_distinct as count_distinct
from fedlang.analytics.histograms import Histogram as Histogram
from fedlang.analytics.histograms import Quantiles as Quantiles
from fedlang.analytics.histograms import build_category_histogram as build_category_histogram
from fedlang.analytics.histograms import build_histogram as build_histogram
from fedlang.analytics.histograms import build_string_histogram as build_string_histogram
from fedlang.analytics.histograms import build_tree_histogram as build_tree_histogram
from fedlang.analytics.histograms import category_histogram as category_histogram
from fedlang.analytics.histograms import histogram as histogram
from fedlang.analytics.histograms import quantiles as quantiles
from fedlang.analytics.histograms import string_histogram as string_histogram
from fedlang.analytics.histograms import tree_quantiles as tree_quantiles
from fedlang.analytics.iblt import IBLT as IBLT
from fedlang.analytics.iblt import iblt_heavy_hitters as iblt_heavy_hitters
from fedlang.analytics.privacy import Privacy as Privacy
from fedlang.analytics.privacy import Spent as Spent
from fedlang.analytics.statistics import Statistics as Statistics
from fedlang.analytics.statistics import build_statistics as build_statistics
from fedlang.analytics.statistics import statistics as statistics
from fedlang.analytics.trie import HeavyHitters as HeavyHitters
from fedlang.analytics.trie import TrieHH as TrieHH
from fedlang.analytics.trie import triehh as triehh
