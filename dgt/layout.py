"""Block layout: a model's parameters as one flat fp32 vector cut into fixed-size blocks,
and the block space split into contiguous shards (one per node, colocated as in BytePS).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_BYTES = 1408  # 352 fp32: one block is one UDP datagram within 1500 B MTU


@dataclass(frozen=True)
class BlockLayout:
    """``n_params`` values in blocks of ``block_elems`` fp32, over ``n_shards`` shards.

    The flat buffer is padded with zeros to ``n_blocks * block_elems`` values. Shard s
    owns blocks ``[shard_lo(s), shard_hi(s))``, a near-equal contiguous split.
    Raises ValueError for a block size that is not a positive multiple of 4 bytes.
    """

    n_params: int
    block_elems: int
    n_shards: int

    @classmethod
    def from_bytes(cls, n_params: int, block_bytes: int, n_shards: int) -> "BlockLayout":
        if block_bytes <= 0 or block_bytes % 4:
            raise ValueError(f"--block-bytes must be a positive multiple of 4, got {block_bytes}")
        if n_params <= 0 or n_shards <= 0:
            raise ValueError("layout needs n_params > 0 and n_shards > 0")
        return cls(n_params, block_bytes // 4, n_shards)

    @property
    def block_bytes(self) -> int:
        return self.block_elems * 4

    @property
    def n_blocks(self) -> int:
        return -(-self.n_params // self.block_elems)

    @property
    def padded(self) -> int:
        return self.n_blocks * self.block_elems

    def shard_lo(self, s: int) -> int:
        return s * self.n_blocks // self.n_shards

    def shard_hi(self, s: int) -> int:
        return (s + 1) * self.n_blocks // self.n_shards

    def shard_blocks(self, s: int) -> int:
        return self.shard_hi(s) - self.shard_lo(s)

    def shard_of(self, block):
        """Shard index per block (int or int64 array/tensor). Inverse of shard_lo/hi."""
        return ((block + 1) * self.n_shards - 1) // self.n_blocks
