"""Secure aggregation semantics: sums the server could compute under secure aggregation.

The secure aggregation protocol (Bonawitz et al., 2017) sums integers in a finite
group, so these factories reproduce exactly what a deployment would compute,
quantization error and modular wrap-around included, rather than a float sum:

* `SecureSumFactory(upper_bound, lower_bound)`: each client clips its value to
  `[lower, upper]`; floats are then quantized to integers in `[0, 2^bits - 1]`
  (`q = round((x - lower) / (upper - lower) * (2^bits - 1))`, stochastic rounding by
  default, which is unbiased; `rounding='deterministic'` rounds to nearest), integers
  are shifted by `-lower`. The codes are summed with `federated_secure_sum_bitwidth`,
  whose group has `2^(bits + ceil(log2 n))` elements, stored in `uint32`: when
  `bits + ceil(log2 n) > 32` the sum wraps modulo `2^32`, as a 32-bit protocol would.
  The server dequantizes: `sum = S * (upper - lower) / (2^bits - 1) + n * lower`, with
  `n` the number of clients (the protocol reveals it). The measurements say how many
  bits the cohort needs (`secure_bits_needed = bits + ceil(log2 n)`) and whether the
  sum may have wrapped (`secure_overflow_risk`: 1 when that exceeds 32; e.g. 24-bit
  codes from 300 clients need 33 bits). Lower `bits` or the cohort size when it is 1.
* A client whose float value has a NaN or an infinity is left out: it sends zero codes
  and is not counted in `n`, so it adds exactly nothing (rather than a bound), and it is
  counted in `secure_nonfinite_count`.
* Adaptive bounds: pass a `QuantileEstimator` as `upper_bound`; it estimates a quantile
  of the clients' `max |x|` and `lower = -upper` (clients report, through a 1-bit
  secure sum, whether their value fits).
* `SecureModularSumFactory(modulus)`: integer values summed modulo `modulus`, exactly.

Type signatures (unweighted):

    SecureSumFactory.create(V) -> AggregationProcess
      initialize: ( -> <bound=...,key=uint32[2]>@SERVER)
      next: (<state, {V}@CLIENTS> -> <state, V@SERVER, <secure_upper_clipped_count=int32,
             secure_lower_clipped_count=int32,secure_upper_threshold=float32,
             secure_lower_threshold=float32,secure_nonfinite_count=int32,
             secure_bits_needed=int32,secure_overflow_risk=int32>@SERVER>)
    SecureModularSumFactory.create(V) -> (<<>@SERVER, {V}@CLIENTS> -> <<>, V@SERVER, <>@SERVER>)
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import factory, quantile, tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, tracing, types

MEASUREMENTS = ("secure_upper_clipped_count", "secure_lower_clipped_count",
                "secure_upper_threshold", "secure_lower_threshold", "secure_nonfinite_count",
                "secure_bits_needed", "secure_overflow_risk")
GROUP_BITS = 32  # the sums are held in uint32, as a 32-bit protocol holds them


def _code_type(value_t: types.Type) -> types.Type:
    return tools.map_type(lambda lt: types.TensorType(np.uint32, lt.shape), value_t)


class SecureSumFactory(factory.UnweightedAggregationFactory):
    """The sum of client values as secure aggregation computes it (module docstring).

    Args:
      upper_bound: the upper clipping bound (a number), or a `QuantileEstimator` of the
        clients' largest absolute value (adaptive bounds).
      lower_bound: the lower bound (default `-upper_bound`).
      bits: the bits per quantized float (1 to 24: float32 holds the codes exactly); ignored for integer values, which
        use `ceil(log2(upper - lower + 1))` bits and are summed exactly.
      rounding: 'stochastic' (unbiased; per-client randomness from a round key and a
        hash of the client's value) or 'deterministic' (round to nearest).
      seed: the seed of the stochastic rounding (None: random).

    Raises:
      TypeError / ValueError: on ill-typed or inconsistent bounds.

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> p = aggregators.SecureSumFactory(10, 0).create(np.int32)
      >>> out = p.next(p.initialize(), [3, 12, -4])
      >>> print(out.result, int(out.measurements['secure_upper_clipped_count']))
      13 1
    """

    def __init__(self, upper_bound: Any, lower_bound: Any = None, *, bits: int = 16,
                 rounding: str = "stochastic", seed: int | None = None):
        self.adaptive = isinstance(upper_bound, quantile.QuantileEstimator)
        if self.adaptive and lower_bound is not None:
            raise ValueError("Expected lower_bound=None with an adaptive upper_bound (it is -upper).")
        if not self.adaptive:
            upper = _number("upper_bound", upper_bound)
            lower = -upper if lower_bound is None else _number("lower_bound", lower_bound)
            if not lower < upper:
                raise ValueError(f"Expected lower_bound < upper_bound, found {lower} >= {upper}.")
            self.bounds: tuple[float, float] = (lower, upper)
        self.upper_bound = upper_bound
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 24:
            raise ValueError(f"Expected bits to be an integer in [1, 24], found {bits!r}.")
        if rounding not in ("stochastic", "deterministic"):
            raise ValueError(
                f"Expected rounding 'stochastic' or 'deterministic', found {rounding!r}."
            )
        self.bits, self.rounding, self.seed = bits, rounding, seed

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the secure sum process for `value_type` (all-float or all-integer)."""
        value_t = factory.check_value_type(value_type, "iuf")
        kinds = {
            leaf.dtype.kind for leaf in cast("list[types.TensorType]", types.tensor_leaves(value_t))
        }
        if len(kinds) > 1 or (kinds & {"i", "u"} and self.adaptive):
            raise TypeError(
                f"Expected all-float values (or all-integer values with fixed bounds), found "
                f"{value_t}. Aggregate the two kinds with separate factories."
            )
        is_float = kinds <= {"f"}
        if not is_float:
            lo, hi = self.bounds
            if lo != math.floor(lo) or hi != math.floor(hi):
                raise ValueError(f"Expected integer bounds for integer values, found {self.bounds}.")
        adaptive, stochastic = self.adaptive, self.rounding == "stochastic"
        bits = self.bits if is_float else max(1, math.ceil(math.log2(self.bounds[1] - self.bounds[0] + 1)))
        levels = float(2**bits - 1)
        code_t = _code_type(value_t)
        bound_t = quantile.STATE_TYPE if adaptive else types.to_type((np.float32, np.float32))
        state_t = types.to_type({"bound": bound_t, "key": tools.KEY_TYPE})
        initial = {"bound": self.upper_bound.initial_state() if adaptive
                   else tuple(np.float32(b) for b in self.bounds),
                   "key": tools.seed_key(self.seed)}
        encoded_t = types.to_type({"codes": code_t, "upper": np.int32, "lower": np.int32,
                                   "fits": np.uint32, "included": np.int32,
                                   "nonfinite": np.int32})
        round_t = types.to_type({"lower": np.float32, "upper": np.float32,
                                 "estimate": np.float32, "key": tools.KEY_TYPE})
        int_bounds = None if is_float else tuple(int(b) for b in self.bounds)
        estimator = self.upper_bound if adaptive else None

        @jax_backend.jax_computation(state_t, result_type={"round": round_t, "state": state_t})
        def prepare(state):
            next_key, round_key = tools.split(state["key"])
            if adaptive:
                u = estimator.threshold(state["bound"])
                lo, hi, estimate = -u, u, state["bound"]["estimate"]
            else:
                lo, hi = state["bound"]
                estimate = hi
            new_state = {"bound": state["bound"], "key": next_key}
            return {"round": {"lower": lo, "upper": hi, "estimate": estimate, "key": round_key},
                    "state": new_state}

        @jax_backend.jax_computation(value_t, round_t, result_type=encoded_t)
        def encode(value, r):
            lo, hi = r["lower"], r["upper"]
            key = tools.client_key(r["key"], value)
            leaves = tools.leaves_of(value, value_t)
            codes, above, below = [], jnp.int32(0), jnp.int32(0)
            biggest = jnp.float32(0)
            finite = jnp.bool_(True)
            for x in leaves if is_float else ():
                finite = finite & jnp.all(jnp.isfinite(x))
            # A non-finite client sends zeros: NaN would otherwise quantize to a bound.
            leaves = [jnp.where(finite, x, jnp.zeros_like(x)) for x in leaves]
            for i, x in enumerate(leaves):
                if is_float:
                    above += jnp.sum(x > hi).astype(jnp.int32)
                    below += jnp.sum(x < lo).astype(jnp.int32)
                    biggest = jnp.maximum(biggest, jnp.max(jnp.abs(x), initial=0.0))
                    scaled = (jnp.clip(x, lo, hi) - lo) / (hi - lo) * levels
                    noise = (jax.random.uniform(jax.random.fold_in(key, i), x.shape)
                             if stochastic else jnp.float32(0.5))
                    codes.append(jnp.clip(jnp.floor(scaled + noise), 0, levels).astype(jnp.uint32))
                else:
                    ilo, ihi = int_bounds
                    above += jnp.sum(x > ihi).astype(jnp.int32)
                    below += jnp.sum(x < ilo).astype(jnp.int32)
                    codes.append((jnp.clip(x, ilo, ihi) - ilo).astype(jnp.uint32))
            fits = (biggest <= r["estimate"]) & finite
            codes = [jnp.where(finite, c, jnp.zeros_like(c)) for c in codes]
            return {"codes": tools.from_leaves(code_t, codes),
                    "upper": jnp.where(finite, above, 0), "lower": jnp.where(finite, below, 0),
                    "fits": fits.astype(jnp.uint32), "included": finite.astype(jnp.int32),
                    "nonfinite": (~finite).astype(jnp.int32)}

        @jax_backend.jax_computation(code_t, round_t, np.int32, result_type=value_t)
        def decode(total, r, n):
            lo, hi = r["lower"], r["upper"]
            leaves = tools.leaves_of(total, code_t)
            out = []
            for s, lt in zip(leaves, types.tensor_leaves(value_t)):
                if is_float:
                    x = s.astype(jnp.float32) * ((hi - lo) / levels) + n.astype(jnp.float32) * lo
                else:
                    x = s.astype(lt.dtype) + n.astype(lt.dtype) * jnp.asarray(int_bounds[0], lt.dtype)
                out.append(x.astype(lt.dtype))
            return tools.from_leaves(value_t, out)

        @jax_backend.jax_computation(np.int32, np.int32)
        def risk(n, nonfinite):
            senders = jnp.maximum(n + nonfinite, 1)  # every client sends codes
            log2_n = jnp.int32(32) - jax.lax.clz((senders - 1).astype(jnp.uint32)).astype(jnp.int32)
            needed = jnp.int32(bits) + log2_n
            return {"bits_needed": needed, "overflow_risk": (needed > GROUP_BITS).astype(jnp.int32)}

        if adaptive:

            @jax_backend.jax_computation(state_t, np.uint32, np.int32, result_type=state_t)
            def update(state, fits_sum, n):
                report_sum = fits_sum.astype(jnp.float32) - 0.5 * n.astype(jnp.float32)
                return {"bound": estimator.update(state["bound"], report_sum, n),
                        "key": state["key"]}

        @tracing.federated_computation()
        def initialize():
            return operators.federated_value(initial, types.SERVER)

        @tracing.federated_computation(types.type_at_server(state_t), types.type_at_clients(value_t))
        def next_fn(state, value):
            prepared = operators.federated_map(prepare, state)
            r = prepared.round
            encoded = operators.federated_map(encode, (value, operators.federated_broadcast(r)))
            total = operators.federated_secure_sum_bitwidth(encoded.codes, bits)
            n = operators.federated_sum(encoded.included)
            nonfinite = operators.federated_sum(encoded.nonfinite)
            result = operators.federated_map(decode, (total, r, n))
            overflow = operators.federated_map(risk, (n, nonfinite))
            new_state = prepared.state
            if adaptive:
                fits = operators.federated_secure_sum_bitwidth(encoded.fits, 1)
                new_state = operators.federated_map(update, (new_state, fits, n))
            measurements = dict(zip(MEASUREMENTS, (
                operators.federated_sum(encoded.upper), operators.federated_sum(encoded.lower),
                r.upper, r.lower, nonfinite, overflow.bits_needed, overflow.overflow_risk)))
            return processes.MeasuredProcessOutput(
                new_state, result, operators.federated_zip(measurements))

        return processes.AggregationProcess(initialize, next_fn)


def _number(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating):
        raise TypeError(f"Expected {name} to be a number, found {type(x).__name__} {x!r}.")
    if not np.isfinite(float(x)):
        raise ValueError(f"Expected a finite {name}, found {x!r}.")
    return float(x)


class SecureModularSumFactory(factory.UnweightedAggregationFactory):
    """Integer client values summed modulo `modulus`, exactly (secure aggregation's group).

    Args:
      modulus: an integer in [2, 2^31 - 1] (the core's moduli are int32 constants).
      symmetric_range: map the result from `[0, modulus)` to
        `[-(modulus - 1) // 2, modulus // 2]` (for values that may be negative).

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> p = aggregators.SecureModularSumFactory(7).create(np.int32)
      >>> print(p.next(p.initialize(), [5, 4, 6]).result)
      1
    """

    def __init__(self, modulus: int, symmetric_range: bool = False):
        if isinstance(modulus, bool) or not isinstance(modulus, int | np.integer) or not (
            2 <= int(modulus) <= 2**31 - 1
        ):
            raise ValueError(f"Expected an integer modulus in [2, 2^31 - 1], found {modulus!r}.")
        self.modulus, self.symmetric_range = int(modulus), bool(symmetric_range)

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the modular sum process for integer `value_type`."""
        value_t = factory.check_value_type(value_type, "iu")
        m, symmetric = self.modulus, self.symmetric_range

        @jax_backend.jax_computation(value_t, result_type=value_t)
        def shift(value):
            return jax.tree.map(lambda x: jnp.where(x > m // 2, x - m, x).astype(x.dtype), value)

        @tracing.federated_computation()
        def initialize():
            return operators.federated_value((), types.SERVER)

        @tracing.federated_computation(initialize.type_signature.result,
                                       types.type_at_clients(value_t))
        def next_fn(state, value):
            total = operators.federated_secure_modular_sum(value, m)
            if symmetric:
                total = operators.federated_map(shift, total)
            return processes.MeasuredProcessOutput(
                state, total, operators.federated_value((), types.SERVER))

        return processes.AggregationProcess(initialize, next_fn)
