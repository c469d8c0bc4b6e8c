"""Keys of seeded randomness: pure functions of integers. Plain Python: must not import torch.

A seeded request's random numbers at output position t are the SplitMix64 stream that starts
at `noise_key(seed, t, stream)`, never a stream whose position depends on earlier steps, so
its tokens are a function of (seed, prompt, sampling settings) alone: the same with speculation
on or off, at any k, in any batch. `stream_uniform` defines the stream; the sampler computes
it for many keys at once on the device (`sampler.keyed_uniforms`), with the same integer bits
on every device.
"""

from __future__ import annotations

# Streams at one position: independent draws for independent uses.
RACE = 0  # the target's exponential race (plain sampling, coupled verification, and the final
#           token of rejection sampling)
ACCEPT = 1  # rejection sampling's uniform for the draft at that position
DRAFT = 2  # a draft model's own race, when verification is not coupled to the target's

_MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # its finalizer's multipliers
UNIFORM_BITS = 23  # a uniform is (top 23 bits + 1/2) / 2^23: exact in float32, never 0 or 1


def _finalize(x: int) -> int:
    x = ((x ^ (x >> 30)) * MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * MIX2) & _MASK64
    return x ^ (x >> 31)


def splitmix64(x: int) -> int:
    """A bijective 64-bit mix (Steele et al.'s SplitMix64 finalizer after one increment)."""
    return _finalize((x + GOLDEN_GAMMA) & _MASK64)


def stream_uniform(key: int, index: int) -> float:
    """Draw `index` (0, 1, ...) of the uniform stream that starts at `key`: SplitMix64's output
    number index + 1 from state `key`, its top UNIFORM_BITS bits as a number in (0, 1)."""
    x = _finalize((key + (index + 1) * GOLDEN_GAMMA) & _MASK64)
    return ((x >> (64 - UNIFORM_BITS)) + 0.5) / (1 << UNIFORM_BITS)


def noise_key(seed: int, position: int, stream: int = RACE) -> int:
    """The key of a seeded request's random numbers at output position `position`, in
    [0, 2^63)."""
    return restream(splitmix64(splitmix64(seed & _MASK64) ^ position) >> 1, stream)


def restream(key: int, stream: int) -> int:
    """The key of another stream at the same position (a RACE key is the base)."""
    return key if stream == RACE else splitmix64(key ^ (stream << 62)) >> 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `n` choices: the request's own for the
    first, distinct and reproducible ones for the others (a signed 64-bit value)."""
    if index == 0:
        return seed
    return (splitmix64(splitmix64(seed & _MASK64) ^ index) >> 1) - (1 << 62)
