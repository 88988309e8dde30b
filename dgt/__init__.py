"""dgt: contribution-aware differential gradient transmission (DGT) for data-parallel
training. The trainer API is :class:`dgt.Client`; the node process is ``dgt sidecar``;
the main job is ``dgt train``."""
from .errors import PeerFailure

__version__ = "0.1.0"
__all__ = ["Client", "PartialStep", "PeerFailure", "__version__"]


def __getattr__(name):  # import torch lazily: 'dgt --help' stays fast
    if name == "Client":
        from .client import Client
        return Client
    if name == "PartialStep":
        from .partial_step import PartialStep
        return PartialStep
    raise AttributeError(name)
