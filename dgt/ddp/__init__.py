"""dgt as a DDP communication hook: ``model.register_comm_hook(DgtState(), dgt_hook)``.

The node's sidecar (one per trainer) starts from the state object under torchrun
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``)
and stops with the job. See docs/ddp.md.
"""
from .generation import init_process_group
from .state import DgtState

__all__ = ["DgtState", "dgt_hook", "init_process_group"]


def __getattr__(name):
    if name == "dgt_hook":
        from .hook import dgt_hook
        return dgt_hook
    raise AttributeError(name)
