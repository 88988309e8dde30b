"""Workloads for dgt: the datasets, partitions and models of ``dgt train``, importable
for your own trainer with :class:`dgt.Client`.

- :mod:`dgt.workloads.datasets`: ``load('fashion-mnist')`` etc. (:class:`Dataset`);
- :mod:`dgt.workloads.partition`: ``split('dirichlet:0.5', labels, N, seed)``,
  :class:`Sampler`, ``class_histograms``;
- :mod:`dgt.workloads.models`: ``build('vgg11', (1, 28, 28), width=0.25, seed=0)``;
- :mod:`dgt.workloads.fedavg`: :class:`FedAvgRound` (push model deltas).

Example::

    from dgt.workloads import datasets, models, partition
    data = datasets.load("fashion-mnist")
    model = models.build("cnn", data.shape, data.classes, seed=0)
    parts = partition.split("shards:2", data.y_train.numpy(), world=4, seed=0)

``python -m dgt.workloads --table`` prints each model's parameters and gradient bytes.
Importing this package imports neither torch nor torchvision; its modules do.
"""
from ..config import WORKLOAD_ALGOS as ALGOS  # noqa: F401
from ..config import WORKLOAD_DATASETS as DATASETS  # noqa: F401
from ..config import WORKLOAD_MODELS as MODELS  # noqa: F401
