"""The order of an epoch's samples: a keyed bijection of [0, n), computed per position.

Design choices:
- A stored permutation costs 8 bytes per sample in every process that draws (ranks and
  loader workers alike); a keyed bijection costs a few integers. ``perm(i)`` is a
  balanced Feistel network on the smallest even number of bits that holds n, with
  *cycle walking*: an output outside [0, n) is fed through again until it lands inside,
  which keeps it a bijection of [0, n) (the walk is on one cycle of a bijection of the
  larger domain, and that cycle returns to i, which is inside). The domain is at most 4n,
  so a position takes a few walks on average.
- Four rounds (the Luby-Rackoff bound for a pseudo-random permutation), each the
  splitmix64 finaliser of the half-block mixed with a round key. The keys come from a
  ``SeedSequence`` of (seed, epoch): the order is a pure function of (seed, epoch, n).
- One formula serves Python ints (a single position, the loader's hot path, without
  numpy's per-call overhead) and uint64 arrays (a batch of positions): every product is
  masked to 64 bits, which a uint64 array does by itself.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_STREAM = 0x5EED  # the shuffle's seed stream; the sample generators use other keys
_M64 = (1 << 64) - 1


def mix64(x, key: int):
    """A keyed 64-bit hash: splitmix64's finaliser of ``x ^ key`` (a Python int, or a uint64
    array elementwise)."""
    z = x ^ key
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class EpochPermutation:
    """``perm(i)``: where position ``i`` of an epoch of ``n`` samples reads, for (seed, epoch)."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        self.n, self.epoch = n, epoch
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        state = np.random.SeedSequence([seed, _STREAM, 0, epoch]).generate_state(_ROUNDS, np.uint64)
        self.keys = tuple(int(k) for k in state)

    def _feistel(self, x):
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right, key) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"position {i} outside [0, {self.n})")
        x = self._feistel(i)
        while x >= self.n:
            x = self._feistel(x)
        return x

    def many(self, positions: np.ndarray) -> np.ndarray:
        """(k,) int64 indices for (k,) positions, all in [0, n)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and not (0 <= positions.min() and positions.max() < self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        x = self._feistel(positions.astype(np.uint64))
        outside = np.flatnonzero(x >= self.n)
        while outside.size:
            x[outside] = self._feistel(x[outside])
            outside = outside[x[outside] >= self.n]
        return x.astype(np.int64)
