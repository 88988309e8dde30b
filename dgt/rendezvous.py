"""Rendezvous through ``torch.distributed.TCPStore`` (rank 0 hosts it).

Waits poll the store instead of blocking in ``get`` so that a failure anywhere in the
job (published under ``dgt/failed``) ends every wait at once with the failed rank named,
and so that no wait outlives ``timeout_s``. All methods block: call them from a thread
(``loop.run_in_executor``), never on the event loop.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta

from .errors import PeerFailure

FAILED = "dgt/failed"
POLL_S = 0.05


class Rendezvous:
    def __init__(self, host: str, port: int, world: int, rank: int, timeout_s: float):
        self.host, self.port, self.world, self.rank = host, port, world, rank
        self.timeout_s = timeout_s
        self.store = self._connect(is_master=rank == 0)

    def _connect(self, is_master: bool):
        from torch.distributed import TCPStore
        try:
            return TCPStore(self.host, self.port, self.world, is_master=is_master,
                            timeout=timedelta(seconds=self.timeout_s),
                            wait_for_workers=False)
        except Exception as e:  # DistStoreError / RuntimeError: one line for the user
            raise PeerFailure(f"rendezvous store at {self.host}:{self.port} unreachable: "
                              f"{str(e).splitlines()[0]}", 0 if not is_master else None) from None

    def set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except Exception as e:
            raise PeerFailure(f"rendezvous store lost (rank 0 died?): {e}".splitlines()[0],
                              0) from None

    def gather(self, prefix: str) -> dict[int, str]:
        """Wait until every rank has set ``prefix/<rank>``; return the values.
        Raises PeerFailure naming a failed rank, or the ranks missing at the timeout."""
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        self.wait(keys)
        try:
            return {r: self.store.get(k).decode() for r, k in enumerate(keys)}
        except Exception as e:
            raise PeerFailure(f"rendezvous store lost (rank 0 died?): {e}".splitlines()[0],
                              0) from None

    def wait(self, keys: list[str]) -> None:
        t_end = time.monotonic() + self.timeout_s
        while True:
            try:
                if self.store.check([FAILED]):
                    info = json.loads(self.store.get(FAILED))
                    raise PeerFailure(info["message"], info.get("rank"))
                if self.store.check(keys):
                    return
            except PeerFailure:
                raise
            except Exception as e:
                raise PeerFailure(f"rendezvous store lost (rank 0 died?): "
                                  f"{str(e).splitlines()[0]}", 0) from None
            if time.monotonic() > t_end:
                missing = [k for k in keys if not self.store.check([k])]
                ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
                raise PeerFailure(f"rank(s) {ranks} did not reach rendezvous step "
                                  f"'{keys[0].rsplit('/', 1)[0]}' within {self.timeout_s:.0f} s",
                                  ranks[0] if ranks else None)
            time.sleep(POLL_S)

    def publish_failure(self, message: str, rank: int | None) -> None:
        """Best effort: tell ranks still in a rendezvous wait that the job failed."""
        try:
            self.store.set(FAILED, json.dumps({"message": message, "rank": rank}))
        except Exception:
            pass
