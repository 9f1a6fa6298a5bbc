"""What a secure aggregation round is: its segments, stages, defaults and its error.

A round sums, for every surviving client, a vector made of *segments*: each segment is
a flat run of integers with its own modulus (one per tensor leaf of the value being
summed). `bitwidth_modulus` gives the modulus `federated_secure_sum_bitwidth` sums in;
`federated_secure_modular_sum`'s modulus is used as is.

Example:
  >>> bitwidth_modulus(8, num_clients=100)
  32768
  >>> default_degree(1000), default_threshold(40)
  (40, 21)
"""

from __future__ import annotations

import dataclasses
import enum
import math

MAX_POWER_OF_TWO_MODULUS = 1 << 64  # segments live in uint64 arrays
MAX_OTHER_MODULUS = 1 << 63  # a + b of two residues must fit in uint64
MAX_CLIENT_ID_LENGTH = 128


class SecAggError(ValueError):
    """A secure aggregation message was rejected, or the round cannot go on safely."""


class Stage(enum.IntEnum):
    """The server's stages, in protocol order (the stage whose messages it accepts)."""

    ADVERTISE_KEYS = 1
    SHARE_KEYS = 2
    MASKED_INPUT = 3
    UNMASKING = 4
    DONE = 5
    FAILED = 6


@dataclasses.dataclass(frozen=True)
class Segment:
    """A flat run of `length` integers summed modulo `modulus`.

    Args:
      length: number of elements (a tensor leaf's size), >= 0.
      modulus: the group the segment is summed in: a power of two up to 2**64, or any
        other integer from 1 up to 2**63.
    """

    length: int
    modulus: int

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 0:
            raise ValueError(f"Expected a segment length >= 0, found {self.length!r}.")
        m = self.modulus
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"Expected a segment modulus >= 1, found {m!r}.")
        if self.is_power_of_two and m > MAX_POWER_OF_TWO_MODULUS:
            raise ValueError(
                f"Expected a power-of-two modulus up to 2**64, found 2**{m.bit_length() - 1}. "
                "Use a smaller bit width."
            )
        if not self.is_power_of_two and m > MAX_OTHER_MODULUS:
            raise ValueError(
                f"Expected a modulus up to 2**63 (or a power of two up to 2**64), found {m}. "
                "Use a smaller modulus."
            )

    @property
    def is_power_of_two(self) -> bool:
        return self.modulus & (self.modulus - 1) == 0


def bitwidth_modulus(bitwidth: int, num_clients: int) -> int:
    """The group `federated_secure_sum_bitwidth` sums in: 2**(bitwidth + ceil(log2 n)).

    Inputs are wrapped modulo 2**bitwidth by the caller; the extra bits make the sum of
    `num_clients` such inputs exact, as in the simulation runtime.
    """
    if bitwidth < 0 or num_clients < 1:
        raise ValueError(
            f"Expected bitwidth >= 0 and num_clients >= 1, found {bitwidth} and {num_clients}."
        )
    extra = math.ceil(math.log2(num_clients)) if num_clients > 1 else 0
    return 1 << (bitwidth + extra)


def default_degree(num_clients: int) -> int:
    """Neighbours per client: the smallest even number >= 4*log2(n), capped at n - 1.

    SecAgg+ (Bell et al. 2020) needs a degree of O(log n) so that, with high probability,
    the graph of honest survivors stays connected and no client is surrounded by dropped
    or colluding neighbours. The constant 4 is a conservative choice for cohorts of tens to
    thousands (10 -> complete graph, 100 -> 28, 1,000 -> 40, 10,000 -> 54); pass `degree`
    to use the paper's bound for your dropout and corruption rates. The degree is even
    because the graph is a Harary graph (each client linked to the k/2 nearest on each side
    of a random ring).
    """
    if num_clients <= 1:
        return 0
    k = 2 * math.ceil(2 * math.log2(num_clients))
    return min(k, num_clients - 1)


def default_threshold(degree: int) -> int:
    """Shares needed to rebuild a client's secret: a strict majority of its holders.

    A client's secrets are shared among itself and its `degree` neighbours. A majority
    threshold means no two disjoint sets of holders can both reach it: a server that
    claimed to some holders that a client dropped and to others that it survived could
    not collect enough shares of both its mask key and its self-mask seed. It tolerates
    up to `degree + 1 - t` holders dropping out.
    """
    return (degree + 1) // 2 + 1
