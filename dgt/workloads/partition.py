"""How the training set is split over the workers: ``--partition``.

- ``iid``: no fixed split. Every epoch one seeded permutation of the whole training set
  is cut into consecutive batches; in iteration i worker r takes the r-th batch of
  slice i (``dgt train``'s original sampling, bit for bit).
- ``dirichlet:ALPHA``: label skew as in Hsu, Qi & Brown 2019 ("Measuring the effects of
  non-identical data distribution for federated visual classification"): for each class
  c a share vector q_c ~ Dir(ALPHA, ..., ALPHA) over the N workers, and worker r gets
  ``q_c[r]`` of class c's samples. Small ALPHA: each worker holds few classes. Redrawn (same
  seed stream) until every worker holds at least one sample.
- ``shards:K``: McMahan et al. 2017 ("Communication-efficient learning of deep networks
  from decentralized data", section 3): the samples sorted by label are cut into N·K
  equal shards, and each worker gets K shards at random: about K classes each.

A fixed split (dirichlet, shards) is drawn once from ``seed`` and is the same on every
rank and in every run. Each epoch every worker shuffles its own samples (seeded by
epoch and rank) and takes consecutive batches, wrapping around when its share is
smaller than an epoch's ``len(train) // (N·batch)`` iterations; so every partition runs
the same number of iterations per epoch and BSP runs compare iteration for iteration.
"""
from __future__ import annotations

import numpy as np

from ..config import real, whole

PARTITIONS = ("iid", "dirichlet:ALPHA", "shards:K")


def parse(text: str, classes: int = 10) -> tuple[str, float]:
    """``iid`` -> ('iid', 0); ``dirichlet:0.5`` -> ('dirichlet', 0.5); ``shards:2`` ->
    ('shards', 2). Raises ValueError with a one-line message that names --partition."""
    name, _, arg = text.strip().partition(":")
    if name == "iid" and not arg:
        return "iid", 0.0
    if name == "dirichlet":
        try:
            alpha = real(arg)   # ASCII: float() also reads '1_0' and '１'
        except ValueError:
            alpha = float("nan")
        if not 0 < alpha < float("inf"):
            raise ValueError(f"--partition {text}: the Dirichlet concentration must be a "
                             f"finite number > 0 (e.g. dirichlet:0.5; smaller is more skewed)")
        return "dirichlet", alpha
    if name == "shards":
        try:
            k = whole(arg)
        except ValueError:
            k = 0
        if not 1 <= k <= classes:
            raise ValueError(f"--partition {text}: K (classes per worker) must be an "
                             f"integer in 1..{classes} (e.g. shards:2)")
        return "shards", float(k)
    raise ValueError(f"--partition {text!r} is unknown; use iid, dirichlet:ALPHA (e.g. "
                     f"dirichlet:0.5) or shards:K (e.g. shards:2)")


def check(text: str, labels: np.ndarray, world: int) -> None:
    """Refuse a partition that cannot give every worker data: ``shards:K`` with more
    shards (N·K) than samples. Raises ValueError (one line)."""
    name, arg = parse(text)
    n, k = len(labels), int(arg)
    if name == "shards" and world * k > n:
        per_class = n // max(1, len(np.unique(labels)))
        # advice that fits when followed: N·K <= n either way
        opts = ([f"--workers <= {n // k}"] if n // k >= 1 else []) + \
            ([f"--partition shards:{n // world}"] if n // world >= 1 else [])
        raise ValueError(f"--partition {text} with --workers {world} needs "
                         f"{world * k} shards but the training set has only "
                         f"{n} samples ({per_class} per class); use "
                         + (" or ".join(opts) if opts else f"--workers <= {n} with "
                            f"--partition shards:1"))


def split(text: str, labels: np.ndarray, world: int, seed: int) -> list[np.ndarray] | None:
    """Each worker's sample indices (int64 arrays, sorted) for a fixed split, or None
    for ``iid``. ``labels``: int (n,). Deterministic in (text, labels, world, seed).
    Raises ValueError (see :func:`check`)."""
    name, arg = parse(text)
    if name == "iid":
        return None
    check(text, labels, world)
    labels = np.asarray(labels)
    rng = np.random.default_rng([seed, 0x5EED])
    if name == "shards":
        k = int(arg)
        order = np.argsort(labels, kind="stable")
        shards = np.array_split(order, world * k)
        pick = rng.permutation(world * k)
        return [np.sort(np.concatenate([shards[s] for s in pick[r * k:(r + 1) * k]]))
                for r in range(world)]
    classes = np.unique(labels)
    for _ in range(1000):
        parts: list[list[np.ndarray]] = [[] for _ in range(world)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            q = rng.dirichlet(np.full(world, arg))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(np.int64)
            for r, part in enumerate(np.split(idx, cuts)):
                parts[r].append(part)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) > 0:
            return out
    raise ValueError(f"--partition {text}: no draw in 1000 gave every one of the "
                     f"{world} workers a sample; use a larger ALPHA or fewer --workers")


def class_histograms(parts: list[np.ndarray] | None, labels: np.ndarray, world: int,
                     classes: int = 10) -> list[list[int]]:
    """Samples per class for each worker (``world`` lists of ``classes`` ints). For
    ``iid`` (``parts`` None) each worker's expected share: the counts of the whole
    training set cut into N near-equal parts."""
    labels = np.asarray(labels)
    if parts is None:
        total = np.bincount(labels, minlength=classes)
        return [[int(v) for v in (total * (r + 1) // world - total * r // world)]
                for r in range(world)]
    return [[int(v) for v in np.bincount(labels[p], minlength=classes)] for p in parts]


class Sampler:
    """The batches of one worker: ``epoch(e)`` gives ``iterations`` index tensors
    (int64, ``batch_size`` each).

    ``parts`` None: iid, the original sampling (one permutation of ``n`` per epoch from
    ``torch.Generator().manual_seed(seed * 100003 + epoch)``, worker ``rank`` takes
    ``perm[i·N·B + r·B : ... + B]``). Else: worker ``rank``'s own indices, reshuffled
    each epoch (seeded by epoch and rank), wrapping around.
    """

    def __init__(self, parts, n: int, world: int, rank: int, batch_size: int, seed: int):
        self.parts, self.n, self.world, self.rank = parts, n, world, rank
        self.batch_size, self.seed = batch_size, seed
        self.iterations = max(1, n // (world * batch_size))

    def epoch(self, e: int):
        import torch
        b = self.batch_size
        g = torch.Generator().manual_seed(self.seed * 100003 + e)
        if self.parts is None:
            perm = torch.randperm(self.n, generator=g)
            per_iter = self.world * b
            for i in range(self.iterations):
                lo = i * per_iter + self.rank * b
                yield perm[lo:lo + b]
            return
        own = torch.from_numpy(self.parts[self.rank])
        g.manual_seed((self.seed * 100003 + e) * 64 + self.rank + 1)
        need = self.iterations * b
        reps = -(-need // len(own))
        order = torch.cat([own[torch.randperm(len(own), generator=g)] for _ in range(reps)])
        for i in range(self.iterations):
            yield order[i * b:(i + 1) * b]
