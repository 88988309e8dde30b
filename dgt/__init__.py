"""dgt: contribution-aware differential gradient transmission (DGT) for data-parallel
training. The trainer API is :class:`dgt.Client`; the node process is ``dgt sidecar``;
the main job is ``dgt train``."""
__version__ = "0.1.0"
__all__ = ["Client", "PartialStep", "PeerFailure", "__version__"]


def __getattr__(name):  # imported when asked for: 'dgt --help' stays fast, and 'dgt'
    # imports next to nothing before its Ctrl-C handling (dgt.cli.main)
    if name == "PeerFailure":
        from .errors import PeerFailure
        return PeerFailure
    if name == "Client":
        from .client import Client
        return Client
    if name == "PartialStep":
        from .partial_step import PartialStep
        return PartialStep
    raise AttributeError(name)
