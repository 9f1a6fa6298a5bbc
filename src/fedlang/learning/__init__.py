"""Federated learning on fedlang: models, optimizers, algorithms, evaluation, metrics.

Everything here is written with fedlang's core (JAX computations and federated
computations), so every piece can be replaced by user code. See docs/learning.md.
"""

from fedlang.core import traffic as traffic
from fedlang.learning import algorithms as algorithms
from fedlang.learning import buffered as buffered
from fedlang.learning import client_works as client_works
from fedlang.learning import composers as composers
from fedlang.learning import distributors as distributors
from fedlang.learning import encoded_broadcast as encoded_broadcast
from fedlang.learning import evaluation as evaluation
from fedlang.learning import finalizers as finalizers
from fedlang.learning import metrics as metrics
from fedlang.learning import model_update_aggregator as model_update_aggregator
from fedlang.learning import models as models
from fedlang.learning import non_trainable as non_trainable
from fedlang.learning import optimizers as optimizers
from fedlang.learning import personalization as personalization
from fedlang.learning import reconstruction as reconstruction
from fedlang.learning import sparse as sparse
from fedlang.learning import templates as templates
from fedlang.learning.buffered import BufferedLearningProcess as BufferedLearningProcess
from fedlang.learning.buffered import (
    compose_buffered_learning_process as compose_buffered_learning_process,
)
from fedlang.learning.model_update_aggregator import (
    compression_aggregator as compression_aggregator,
)
from fedlang.learning.model_update_aggregator import dp_aggregator as dp_aggregator
from fedlang.learning.model_update_aggregator import robust_aggregator as robust_aggregator
from fedlang.learning.model_update_aggregator import secure_aggregator as secure_aggregator
from fedlang.learning.models.model import ModelWeights as ModelWeights
from fedlang.learning.templates import LearningProcess as LearningProcess
from fedlang.learning.templates import LearningProcessOutput as LearningProcessOutput
