"""The messages a node sends besides its push (the push is transport.sender's): HELLO
on each connection it dials, PULL from its shard to each worker, BYE when its trainer is
done, ERROR when the job fails. One encoder each, used by the sidecar and the tools
alike, so the bytes are those of docs/wire.md everywhere. ``key``: the job secret
(keyed BLAKE2b MAC on every message) or None."""
from __future__ import annotations

import numpy as np

from . import wire
from .wire import MsgType

#: the ``block`` field of an ERROR that names no rank
NO_RANK = 0xFFFFFFFF
#: ERROR's ``block`` when the shard refuses the connection the ERROR comes on: it said
#: HELLO for a rank that another connection holds there (docs/wire.md, "Connections")
REFUSED = 0xFFFFFFFE


def hello(session: int, sender: int, shard: int, key: bytes | None) -> bytes:
    """HELLO from rank ``sender`` on the connection it dialled to ``shard``."""
    return wire.encode(MsgType.HELLO, session=session, sender=sender, shard=shard, key=key)


def bye(session: int, sender: int, pushed: int, key: bytes | None) -> bytes:
    """BYE: ``sender``'s trainer is done after ``pushed`` iterations (``count``)."""
    return wire.encode(MsgType.BYE, session=session, sender=sender, count=pushed, key=key)


def error(session: int, sender: int, failed: int | None, message: str,
          key: bytes | None) -> bytes:
    """ERROR: the job failed; ``failed``: the rank at fault (``block``) or None;
    ``message``: UTF-8, cut to 1,000 bytes."""
    return wire.encode(MsgType.ERROR, session=session, sender=sender,
                       block=failed if failed is not None else NO_RANK,
                       payload=message.encode()[:1000], key=key)


def pull(session: int, shard: int, iteration: int, lo: int, aggregate: np.ndarray,
         received: np.ndarray, key: bytes | None, coded=None) -> list:
    """PULL(``iteration``) from ``shard``, whose blocks start at ``lo``: ``aggregate``
    ((count * block elements,) float32, sent as a view: do not write it until sent) and
    ``received`` ((count,) bool: the worker's blocks that arrived). With ``coded`` (a
    ``(coding, plain, payloads, coded)`` tuple, ``wire.coded_pull_parts``' arguments
    but ``received``: ``--pull-codec``), the blocks marked in ``coded`` go in that
    coding instead and ``aggregate`` is not sent. A list of buffers for one write."""
    if coded is None:
        parts, flags = wire.pull_parts(aggregate, received), 0
    else:
        coding, plain, payloads, mask = coded
        parts = wire.coded_pull_parts(plain, payloads, received, mask)
        flags = int(coding) << wire.CODING_SHIFT
    return wire.encode_parts(MsgType.PULL, session=session, sender=shard, shard=shard,
                             iteration=iteration, block=lo, count=received.size,
                             parts=parts, flags=flags, key=key)
