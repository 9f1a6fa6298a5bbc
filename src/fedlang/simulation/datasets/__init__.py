"""Ready-made federated datasets: TFF's SQLite files, generated and bundled data."""

from fedlang.simulation.datasets import cifar100 as cifar100
from fedlang.simulation.datasets import emnist as emnist
from fedlang.simulation.datasets import shakespeare as shakespeare
from fedlang.simulation.datasets import stackoverflow as stackoverflow
from fedlang.simulation.datasets.generated import digits as digits
from fedlang.simulation.datasets.generated import digits_train_test as digits_train_test
from fedlang.simulation.datasets.generated import synthetic as synthetic
