"""Rank lists in messages, one way everywhere: short lists whole, long ones abbreviated.

A job has at most :data:`dgt.config.MAX_WORLD` ranks, but a message that printed every
rank of a long list made an ERROR line, and the failure record holding it, as long as
the list (outside tester: ``dgt sidecar --world 100000`` printed one 689 kB line naming
ranks 1..99999). Every message that names ranks (``rank(s) …``, ``shard(s) …``) formats
them with :func:`rank_list`.
"""
from __future__ import annotations

#: lists up to this long are shown whole, as Python prints them (``[2]``, ``[0, 1, 3]``)
WHOLE = 8
#: a longer list shows its first this many, then its last, then how many
HEAD = 5


def rank_list(ranks, noun: str = "ranks") -> str:
    """``[2]``, ``[0, 1, 3]``; past :data:`WHOLE` items ``[1, 2, 3, 4, 5, …, 99999]
    (99999 ranks)``. ``ranks``: ints in the order to show (any iterable); ``noun``: what
    the count counts."""
    rs = [int(r) for r in ranks]
    if len(rs) <= WHOLE:
        return str(rs)
    return f"[{', '.join(map(str, rs[:HEAD]))}, …, {rs[-1]}] ({len(rs)} {noun})"
