"""Learning algorithms, each returning a `LearningProcess` (names follow TFF)."""

from fedlang.learning.algorithms.ditto import build_ditto as build_ditto
from fedlang.learning.algorithms.ditto import build_ditto_eval as build_ditto_eval
from fedlang.learning.algorithms.fed_avg import build_fed_adagrad as build_fed_adagrad
from fedlang.learning.algorithms.fed_avg import build_fed_adam as build_fed_adam
from fedlang.learning.algorithms.fed_avg import build_fed_prox as build_fed_prox
from fedlang.learning.algorithms.fed_avg import build_fed_yogi as build_fed_yogi
from fedlang.learning.algorithms.fed_avg import build_unweighted_fed_avg as build_unweighted_fed_avg
from fedlang.learning.algorithms.fed_avg import build_weighted_fed_avg as build_weighted_fed_avg
from fedlang.learning.algorithms.fed_buff import build_fed_buff as build_fed_buff
from fedlang.learning.algorithms.fed_eval import build_fed_eval as build_fed_eval
from fedlang.learning.algorithms.fed_per import build_fed_per as build_fed_per
from fedlang.learning.algorithms.fed_per import build_fed_per_eval as build_fed_per_eval
from fedlang.learning.algorithms.fed_recon import build_fed_recon as build_fed_recon
from fedlang.learning.algorithms.fed_recon import build_fed_recon_eval as build_fed_recon_eval
from fedlang.learning.algorithms.fed_sgd import build_fed_sgd as build_fed_sgd
from fedlang.learning.algorithms.kmeans import build_fed_kmeans as build_fed_kmeans
from fedlang.learning.algorithms.mime import build_mime_lite as build_mime_lite
from fedlang.learning.algorithms.personalization_eval import (
    build_personalization_eval as build_personalization_eval,
)
from fedlang.learning.algorithms.q_ffl import build_q_fed_avg as build_q_fed_avg
from fedlang.learning.algorithms.scaffold import build_scaffold as build_scaffold
