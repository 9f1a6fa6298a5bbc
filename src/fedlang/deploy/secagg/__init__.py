"""SecAgg+ secure aggregation: the server learns the sum of the clients' vectors, not them.

The protocol of Bonawitz et al. (CCS 2017) with the neighbour graph of Bell et al. (CCS
2020), on X25519, HKDF-SHA256, AES-GCM and AES-CTR from the `cryptography` package. It is
a message-passing library: `SecAggServer` and `SecAggClient` exchange bytes (see
`docs/deploy.md`, "Secure aggregation"); `run_round` runs a whole round in one process.
"""

from fedlang.deploy.secagg.client import SecAggClient as SecAggClient
from fedlang.deploy.secagg.config import SecAggError as SecAggError
from fedlang.deploy.secagg.config import Segment as Segment
from fedlang.deploy.secagg.config import Stage as Stage
from fedlang.deploy.secagg.config import bitwidth_modulus as bitwidth_modulus
from fedlang.deploy.secagg.config import default_degree as default_degree
from fedlang.deploy.secagg.config import default_threshold as default_threshold
from fedlang.deploy.secagg.driver import RoundReport as RoundReport
from fedlang.deploy.secagg.driver import run_round as run_round
from fedlang.deploy.secagg.server import SecAggServer as SecAggServer
