"""Seed-invariant sampling: a seeded row's token at each position is a function of the seed,
the position and the distribution there, and of nothing else.

Legend: V vocabulary, S tokens a noise block, N blocks (ceil(V / S)).

What it is. The exponential race (the Gumbel-max trick written with exponential clocks): with
E_v ~ Exp(1) independent over the vocabulary, token v "arrives" at E_v / p_v and the first
arrival, argmin_v E_v / p_v, has law p exactly (a minimum of independent Exp(p_v) clocks is the
clock of v with probability p_v / sum p). The clocks of a position are keyed by (seed, lane,
position) (:func:`position_key`), so:
  * the target's sample at a position is fixed by the seed and its own processed distribution
    there: plain decoding and speculative decoding with any proposer, k, depth policy or batch
    mates emit the same tokens (verification keeps draft tokens while they equal the target's
    race winner, engine/verification.py);
  * a draft model that races its own distribution on the same clocks proposes the target's
    token with probability >= (1 - TV) / (1 + TV) (Daliri, Musco, Suresh 2024, "Coupling
    without Communication and Drafter-Invariant Speculative Decoding"); a deterministic draft
    (n-gram) is compared as it is. The draft's probabilities play no part in the decision:
    shared noise with a p / q ratio test would bias the output.

Lazy clocks. Drawing V exponentials per position costs more than a small model's step on a CPU
(the whole vocabulary through the generator and a log), so the clocks of a position are drawn
by blocks of S tokens, exactly: a block's smallest clock M_b ~ Exp(S) and the place J_b it is
at (uniform) come first, for every block; the other clocks of the block are M_b plus
independent Exp(1) excesses (the memorylessness of the minimum), drawn only when the block
could hold the winner: a block whose smallest clock over its largest probability, M_b / P_b,
is not below the best arrival found so far cannot. The clocks are the same whichever blocks a
race opens (a block's excesses are read at its own counters of a counter-based generator), so
the draft's race and the target's run on one set of clocks.

Not here: the rejection rule for unseeded rows (rejection.py, block.py), where the rows'
distributions come from (sampling.to_probs), the loop (engine/batch.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import NonFiniteError

# tokens a block of clocks. A race's work is N = V / S for the block minima and S for each block
# it opens; a block is opened with probability about S * A * P_b (A the winner's arrival, P_b the
# block's largest probability), so about S of them at most: S near V ** (1/3) balances the two.
BLOCK_SIZE = 32
_TINY = np.finfo(np.float64).tiny
_MASK64 = (1 << 64) - 1
# SplitMix64's increment and finaliser multipliers: _mix64 on Python ints (keys, seeds),
# _splitmix64_uniforms on numpy arrays (a block's excesses)
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints that spreads every input bit."""
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * _MUL1) & _MASK64
    value = ((value ^ (value >> 27)) * _MUL2) & _MASK64
    return value ^ (value >> 31)


def stream_key(seed: int, lane: int = 0) -> int:
    """The key of one seeded row's clocks. ``lane``: which row of a generation that gives every
    row one seed (engine.engine.DecodingRun: row i is lane i); rows seeded one by one are
    lane 0."""
    return _mix64(_mix64(seed) ^ lane)


def position_key(key: int, position: int) -> int:
    """The key of the clocks of ``position`` (the index of a new token, 0 for the first one
    generated) under a row's ``key``."""
    return _mix64(key ^ _mix64(position))


def block_seed(position_key: int) -> int:
    """The torch seed of a position's block minima. -> an int in [0, 2**63)."""
    return _mix64(position_key) >> 1


class RaceClocks:
    """The exponential clocks E_v ~ Exp(1) (v < V) of one position, drawn by blocks on demand.

    block_min [N] fp64: each block's smallest clock M_b; block_argmin [N] int64: where in the
    block it is, flat_argmin [N] where in the vocabulary (clocks past V, in the last block,
    exist but never win: their probability is 0).
    The minima come from a torch.Generator seeded by the position's key, a block's excesses
    from a counter-based generator keyed the same way (:func:`_splitmix64_uniforms`); the
    arithmetic is numpy's, whose per-call cost on vectors of a few hundred entries is a
    fraction of torch's (a race is a dozen such calls).
    """

    def __init__(self, key: int, position: int, vocab_size: int,
                 block_size: int = BLOCK_SIZE) -> None:
        assert block_size & (block_size - 1) == 0, "blocks of a power of two (race's row max)"
        self.position_key, self.block_size = position_key(key, position), block_size
        self.num_blocks = -(-vocab_size // block_size)
        generator = torch.Generator().manual_seed(block_seed(self.position_key))
        uniforms = torch.rand(self.num_blocks, generator=generator, dtype=torch.float64).numpy()
        # [N] Exp(S) each; kept above 0 so that an arrival M_b / p is never 0 / 0
        self.block_min = np.maximum(-np.log1p(-uniforms) / block_size, _TINY)
        self.block_argmin = torch.randint(block_size, (self.num_blocks,),
                                          generator=generator).numpy()
        # [N] where each block's minimum is in the vocabulary, flat (the race reads probs there)
        self.flat_argmin = np.arange(self.num_blocks) * block_size + self.block_argmin
        self._opened: dict[int, np.ndarray] = {}  # block -> its S clocks, fp64

    def blocks(self, indices: list[int]) -> np.ndarray:
        """The clocks of these blocks, [len(indices), S] fp64, the same on every call."""
        missing = [index for index in indices if index not in self._opened]
        if missing:
            minima = self.block_min[missing]
            uniforms = _splitmix64_uniforms(self.position_key, np.array(missing, np.uint64),
                                            self.block_size)
            clocks = -np.log1p(-uniforms) + minima[:, None]  # [m, S]
            clocks[np.arange(len(missing)), self.block_argmin[missing]] = minima
            for row, index in enumerate(missing):
                self._opened[index] = clocks[row]
        return np.stack([self._opened[index] for index in indices])


def _splitmix64_uniforms(key: int, blocks: np.ndarray, block_size: int) -> np.ndarray:
    """Uniforms in [0, 1) [m, S] fp64 for these blocks: SplitMix64's stream seeded by ``key``
    read at counters b * S + i. A counter-based generator, so that block b's excesses are the
    same whichever blocks a race opens, and drawing m blocks is a few vector operations (a
    torch.Generator seeded per block cost more than the rest of the race)."""
    counters = blocks[:, None] * np.uint64(block_size) + np.arange(block_size, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the algorithm
        state = np.uint64(key) + (counters + np.uint64(1)) * np.uint64(_GOLDEN)
        state = (state ^ (state >> np.uint64(30))) * np.uint64(_MUL1)
        state = (state ^ (state >> np.uint64(27))) * np.uint64(_MUL2)
        state ^= state >> np.uint64(31)
    return (state >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def race(probs: torch.Tensor, clocks: RaceClocks) -> int:
    """The first arrival argmin_v E_v / p_v of ``probs`` [V] (any device, need not be
    normalised, >= 0 with a positive sum) on ``clocks``: a sample of probs' law.

    Opens the blocks whose bound M_b / P_b is below the best arrival found so far: first the
    nearest one, then, with the best arrival it gives, every block still below it. Exact ties
    between arrivals (probability 0) go to the lower id.
    Raises NonFiniteError for a row with no positive probability.
    """
    block_size, num_blocks = clocks.block_size, clocks.num_blocks
    flat = probs.detach().to("cpu", torch.float32).numpy()  # [V], the probs' memory on a CPU
    if flat.shape[0] != num_blocks * block_size:  # a last block short of S: pad it with zeros
        flat = np.concatenate([flat, np.zeros(num_blocks * block_size - flat.shape[0],
                                              dtype=np.float32)])
    at_min = flat[clocks.flat_argmin].astype(np.float64)  # [N] where each block's minimum is
    with np.errstate(divide="ignore"):  # p = 0: an arrival never (inf)
        arrivals = clocks.block_min / at_min  # [N] each block's smallest clock's arrival
        bounds = clocks.block_min / _block_max(flat, num_blocks)  # [N] none in a block sooner
    best_block = int(arrivals.argmin())
    best = (float(arrivals[best_block]),
            best_block * block_size + int(clocks.block_argmin[best_block]))
    nearest = int(bounds.argmin())
    blocks = flat.reshape(num_blocks, block_size)  # [N, S] fp32
    if bounds[nearest] < best[0]:
        best = min(best, _open(blocks, clocks, [nearest]))
    rest = [index for index in np.flatnonzero(bounds < best[0]).tolist() if index != nearest]
    if rest:
        best = min(best, _open(blocks, clocks, rest))
    if not math.isfinite(best[0]):
        raise NonFiniteError("race needs probabilities >= 0 with a positive sum; got a row "
                             "with none above 0.")
    return best[1]


def _block_max(flat: np.ndarray, num_blocks: int) -> np.ndarray:
    """Each block's largest entry, flat [N * S] fp32 (S a power of two) -> [N] fp64, as maxima
    of neighbouring pairs, log2(S) passes over ever shorter vectors: numpy reduces a short
    axis an element at a time, and a row-wise halving of [N, S] does too."""
    while flat.shape[0] > num_blocks:
        flat = np.maximum(flat[0::2], flat[1::2])
    return flat.astype(np.float64)


def _open(blocks: np.ndarray, clocks: RaceClocks, indices: list[int]) -> tuple[float, int]:
    """The first arrival among these blocks: (arrival, token). blocks [N, S] fp32 probs."""
    with np.errstate(divide="ignore"):
        arrivals = clocks.blocks(indices) / blocks[indices]  # [m, S] fp64 (inf where p is 0)
    flat = int(arrivals.argmin())
    row, column = divmod(flat, clocks.block_size)
    return float(arrivals[row, column]), indices[row] * clocks.block_size + column
