"""Default inputs shared with the C++ client (attention_client): uniform values in
[-1, 1) from SplitMix64, so both clients send the same request for the same seed
and shapes.

    queries, keys, values = uniform_inputs(0, [(2, 4, 100), (2, 6, 100), (2, 6, 100)])

The generator, all arithmetic mod 2**64, state = seed:

    state += 0x9E3779B97F4A7C15
    z = state
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z ^= z >> 31
    value = float32(float64(z >> 11) * 2**-53 * 2.0 - 1.0)

One stream fills every tensor in turn, row-major: the queries (B, Q, d_q), then the
keys (B, K, d_k), then the values (B, K, d_v). The n-th draw's state is
seed + n * 0x9E3779B97F4A7C15, so the stream is computed vectorised with numpy's
wrapping uint64 arithmetic.
"""

import math

import numpy as np

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
DEFAULT_BATCH = 2
DEFAULT_NUM_QUERIES = 4
DEFAULT_NUM_KEYS = 6
DEFAULT_VALID_LENS = (3, 2)


def uniform_stream(seed, count, start=0):
    """Draws start .. start+count-1 of the stream of `seed` as float32."""
    n = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed % 2**64) + n * np.uint64(GOLDEN_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    unit = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return (unit * 2.0 - 1.0).astype(np.float32)


def uniform_inputs(seed, shapes):
    """One float32 array per shape, filled in order from one stream of `seed`."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = uniform_stream(seed, sum(sizes))
    arrays, offset = [], 0
    for shape, size in zip(shapes, sizes):
        arrays.append(flat[offset:offset + size].reshape(shape))
        offset += size
    return arrays
