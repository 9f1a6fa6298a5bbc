"""Compression: lossy encoders for client uploads and server broadcasts, with bit counts.

An `Encoder` decides per tensor how it travels: tensors with at most `threshold`
elements (and non-float tensors) are sent as they are; larger float tensors are

* `quantize(bits)`: uniformly quantized to `bits` bits between the tensor's own min and
  max, with stochastic (unbiased) rounding, optionally after a random Hadamard
  rotation (`rotation='hadamard'`); the message is the codes plus min and max (and the
  rotation seed);
* `top_k(fraction)`: only the `ceil(fraction * n)` largest-magnitude entries, as
  indices and values.

Bits are counted as a bit-packed wire format would send them: 32 per float32 sent
as is, `bits` per code plus 64 for min/max (64 more for a rotation seed), and
`k * (ceil(log2 n) + 32)` for top-k. (In memory codes are uint8/16/32.)

`EncodedSumFactory(encoder)` sums encoded client values: each client encodes (its
randomness from the broadcast round key and a hash of its value), the server decodes
each message as it arrives and adds it (`federated_aggregate`), since messages with
different min/max cannot be summed encoded. Type signature:

    create(V) -> AggregationProcess
      initialize: ( -> <key=uint32[2]>@SERVER)
      next: (<state, {V}@CLIENTS> -> <state, V@SERVER,
             <aggregated_bits=float32,uncompressed_bits=float32>@SERVER>)

Use it for a mean with `MeanFactory(value_sum_factory=EncodedSumFactory.quantize(8))`;
`fedlang.learning.encoded_broadcast.build_encoded_broadcast_process` is the broadcast side.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import factory, hadamard, tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, tracing, types

KINDS = ("identity", "quantize", "top_k")


@dataclasses.dataclass(frozen=True)
class Encoder:
    """How tensors are encoded (module docstring). Build with the class methods.

    Raises:
      ValueError: on an unknown kind or out-of-range parameter.
    """

    kind: str = "identity"
    bits: int = 8
    threshold: int = 10_000
    rotation: str | None = None
    fraction: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Expected an encoder kind in {KINDS}, found {self.kind!r}.")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
            raise ValueError(f"Expected bits to be an integer in [1, 16], found {self.bits!r}.")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 0:
            raise ValueError(f"Expected threshold to be an integer >= 0, found {self.threshold!r}.")
        if self.rotation not in (None, "hadamard"):
            raise ValueError(f"Expected rotation None or 'hadamard', found {self.rotation!r}.")
        f = tools.check_number("fraction", self.fraction, 0.0, strict=True)
        if f > 1:
            raise ValueError(f"Expected fraction in (0, 1], found {f}.")

    @classmethod
    def quantize(cls, bits: int = 8, threshold: int = 10_000, rotation: str | None = None) -> Encoder:
        """Uniform `bits`-bit quantization of float tensors with more than `threshold` elements."""
        return cls("quantize", bits=bits, threshold=threshold, rotation=rotation)

    @classmethod
    def top_k(cls, fraction: float = 0.01, threshold: int = 10_000) -> Encoder:
        """Top-k sparsification (the `fraction` largest |x|) of larger float tensors."""
        return cls("top_k", fraction=fraction, threshold=threshold)

    @classmethod
    def identity(cls) -> Encoder:
        """Sends everything as is (the uncompressed baseline, with bit counts)."""
        return cls("identity")

    # -- per-tensor plans ------------------------------------------------------------

    def _leaf_kind(self, lt: types.TensorType) -> str:
        size = int(np.prod(cast("tuple[int, ...]", lt.shape)))
        if self.kind == "identity" or lt.dtype.kind != "f" or size <= self.threshold:
            return "identity"
        return self.kind

    def _code_dtype(self) -> Any:
        return np.uint8 if self.bits <= 8 else np.uint16

    def _leaf_message_type(self, lt: types.TensorType) -> types.Type:
        kind, size = self._leaf_kind(lt), int(np.prod(cast("tuple[int, ...]", lt.shape)))
        if kind == "identity":
            return lt
        if kind == "top_k":
            k = self._k(size)
            return types.to_type({"indices": (np.int32, [k]), "values": (lt.dtype, [k])})
        m = hadamard.padded_size(size) if self.rotation else size
        fields: dict[str, Any] = {"codes": (self._code_dtype(), [m]), "min": np.float32,
                                  "max": np.float32}
        if self.rotation:
            fields["seed"] = tools.KEY_TYPE
        return types.to_type(fields)

    def _k(self, size: int) -> int:
        return max(1, min(size, math.ceil(self.fraction * size)))

    def message_type(self, value_type: Any) -> types.Type:
        """The type of one encoded value: a struct with one message per tensor."""
        leaves = cast("list[types.TensorType]", types.tensor_leaves(types.to_type(value_type)))
        return types.StructType([(None, self._leaf_message_type(lt)) for lt in leaves])

    def bits_per_value(self, value_type: Any) -> int:
        """The bits one encoded value of `value_type` takes on the wire."""
        total = 0
        for lt in cast("list[types.TensorType]", types.tensor_leaves(types.to_type(value_type))):
            kind, size = self._leaf_kind(lt), int(np.prod(cast("tuple[int, ...]", lt.shape)))
            if kind == "identity":
                total += size * lt.dtype.itemsize * 8
            elif kind == "top_k":
                total += self._k(size) * (max(1, math.ceil(math.log2(size))) + lt.dtype.itemsize * 8)
            else:
                m = hadamard.padded_size(size) if self.rotation else size
                total += m * self.bits + 64 + (64 if self.rotation else 0)
        return total

    # -- JAX encode / decode -----------------------------------------------------------

    def encode(self, value: Any, key: Any, value_type: Any) -> list[Any]:
        """JAX: the message (a list, one entry per tensor) for `value`, random from `key`."""
        out = []
        leaf_types = cast("list[types.TensorType]", types.tensor_leaves(types.to_type(value_type)))
        for i, (x, lt) in enumerate(zip(tools.leaves_of(value, value_type), leaf_types)):
            kind, k_i = self._leaf_kind(lt), jax.random.fold_in(key, i)
            if kind == "identity":
                out.append(x)
            elif kind == "top_k":
                flat = jnp.ravel(x)
                _, idx = jax.lax.top_k(jnp.abs(flat), self._k(flat.shape[0]))
                out.append({"indices": idx.astype(jnp.int32), "values": flat[idx]})
            else:
                out.append(self._quantize(x, k_i))
        return out

    def _quantize(self, x: Any, key: Any) -> dict[str, Any]:
        rot_key, round_key = jax.random.split(key)
        flat = hadamard.rotate(x, rot_key) if self.rotation else jnp.ravel(x).astype(jnp.float32)
        lo, hi = jnp.min(flat), jnp.max(flat)
        levels = jnp.float32(2**self.bits - 1)
        scale = jnp.where(hi > lo, (hi - lo) / levels, jnp.float32(1))
        u = jax.random.uniform(round_key, flat.shape)
        codes = jnp.clip(jnp.floor((flat - lo) / scale + u), 0, levels).astype(self._code_dtype())
        msg = {"codes": codes, "min": lo, "max": hi}
        if self.rotation:
            msg["seed"] = jax.random.key_data(rot_key)
        return msg

    def decode(self, message: list[Any], value_type: Any) -> list[Any]:
        """JAX: the decoded tensor leaves of one message."""
        out = []
        for msg, lt in zip(
            message, cast("list[types.TensorType]", types.tensor_leaves(types.to_type(value_type)))
        ):
            kind, size = self._leaf_kind(lt), int(np.prod(cast("tuple[int, ...]", lt.shape)))
            if kind == "identity":
                out.append(msg)
            elif kind == "top_k":
                dense = jnp.zeros([size], lt.dtype).at[msg["indices"]].set(msg["values"])
                out.append(dense.reshape(lt.shape))
            else:
                levels = jnp.float32(2**self.bits - 1)
                lo, hi = msg["min"], msg["max"]
                scale = jnp.where(hi > lo, (hi - lo) / levels, jnp.float32(1))
                flat = lo + msg["codes"].astype(jnp.float32) * scale
                if self.rotation:
                    flat = hadamard.unrotate(flat, tools.wrap(msg["seed"]), size)
                out.append(flat.reshape(lt.shape).astype(lt.dtype))
        return out


unflatten = tools.from_leaves


class EncodedSumFactory(factory.UnweightedAggregationFactory):
    """The sum of encoded (compressed) client values, with the bits sent (module docstring).

    Args:
      encoder: an `Encoder`.
      seed: the seed of the stochastic rounding (None: random).

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> f = aggregators.EncodedSumFactory.quantize(8, threshold=2)
      >>> p = f.create((np.float32, [4]))
      >>> out = p.next(p.initialize(), [np.array([0.0, 1.0, 2.0, 3.0])] * 2)
      >>> print(np.round(out.result, 4), out.measurements['aggregated_bits'])
      [0. 2. 4. 6.] 192.0
    """

    def __init__(self, encoder: Encoder, seed: int | None = None):
        if not isinstance(encoder, Encoder):
            raise TypeError(f"Expected an Encoder, found {type(encoder).__name__}.")
        self.encoder, self.seed = encoder, seed

    @classmethod
    def quantize(cls, bits: int = 8, threshold: int = 10_000, rotation: str | None = None,
                 seed: int | None = None) -> EncodedSumFactory:
        """Sums `bits`-bit quantized tensors (those with more than `threshold` elements)."""
        return cls(Encoder.quantize(bits, threshold, rotation), seed)

    @classmethod
    def top_k(cls, fraction: float = 0.01, threshold: int = 10_000,
              seed: int | None = None) -> EncodedSumFactory:
        """Sums top-k sparsified tensors (those with more than `threshold` elements)."""
        return cls(Encoder.top_k(fraction, threshold), seed)

    @classmethod
    def identity(cls) -> EncodedSumFactory:
        """The uncompressed sum, reporting the bits it sends (the baseline)."""
        return cls(Encoder.identity(), 0)

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the encoded sum process for `value_type` (tensors of known shape)."""
        value_t = factory.check_value_type(value_type)
        if not all(
            lt.is_fully_defined
            for lt in cast("list[types.TensorType]", types.tensor_leaves(value_t))
        ):
            raise TypeError(f"Expected tensors of fully known shape, found {value_t}.")
        enc = self.encoder
        msg_t = enc.message_type(value_t)
        bits = float(enc.bits_per_value(value_t))
        raw = float(Encoder.identity().bits_per_value(value_t))
        state_t = types.to_type({"key": tools.KEY_TYPE})
        initial = {"key": tools.seed_key(self.seed)}

        @jax_backend.jax_computation(state_t, result_type={"state": state_t, "round": tools.KEY_TYPE})
        def prepare(state):
            next_key, round_key = tools.split(state["key"])
            return {"state": {"key": next_key}, "round": round_key}

        @jax_backend.jax_computation(value_t, tools.KEY_TYPE, result_type=msg_t)
        def encode(value, round_key):
            return enc.encode(value, tools.client_key(round_key, value), value_t)

        @jax_backend.jax_computation(result_type=value_t)
        def zeros():
            return tools.zeros(value_t)

        @jax_backend.jax_computation(value_t, msg_t, result_type=value_t)
        def accumulate(total, message):
            decoded = enc.decode(list(message), value_t)
            return unflatten(value_t, [t + d for t, d in zip(tools.leaves_of(total, value_t), decoded)])

        @jax_backend.jax_computation(value_t, value_t, result_type=value_t)
        def merge(a, b):
            return unflatten(value_t, [x + y for x, y in zip(tools.leaves_of(a, value_t), tools.leaves_of(b, value_t))])

        @jax_backend.jax_computation(value_t, result_type=value_t)
        def report(total):
            return total

        @jax_backend.jax_computation(np.int32)
        def count_bits(n):
            f = n.astype(jnp.float32)
            return {"aggregated_bits": f * bits, "uncompressed_bits": f * raw}

        @tracing.federated_computation()
        def initialize():
            return operators.federated_value(initial, types.SERVER)

        @tracing.federated_computation(types.type_at_server(state_t), types.type_at_clients(value_t))
        def next_fn(state, value):
            prepared = operators.federated_map(prepare, state)
            key = operators.federated_broadcast(prepared.round)
            messages = operators.federated_map(encode, (value, key))
            total = operators.federated_aggregate(messages, zeros(), accumulate, merge, report)
            measurements = operators.federated_map(count_bits, tools.count_clients(value))
            return processes.MeasuredProcessOutput(prepared.state, total, measurements)

        return processes.AggregationProcess(initialize, next_fn)
