"""Sample order for one epoch and its split among consumers (ranks x DataLoader workers).

The order is a permutation of the global sample ids (index rows) derived from (seed, epoch) only:
shards in a random order, the samples of each shard in a random order, so a consumer walks one
shard at a time. Consumers take every W-th sample of what remains, padded by wrapping around so
every consumer gets the same count and none waits for a peer that has nothing (W > shards,
W > samples). Resuming from ``consumed`` samples keeps exactly the rest of the same order.
"""

import numpy as np


def epoch_order(rows_by_shard: list[np.ndarray], seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Global sample ids in this epoch's order."""
    if not rows_by_shard:
        return np.empty(0, dtype=np.int64)
    if not shuffle:
        return np.concatenate(rows_by_shard).astype(np.int64)
    rng = np.random.default_rng([seed, epoch])
    parts = [rng.permutation(rows_by_shard[s]) for s in rng.permutation(len(rows_by_shard))]
    return np.concatenate(parts).astype(np.int64)


def consumer_share(order: np.ndarray, consumed: int, consumer: int, consumers: int) -> np.ndarray:
    """The samples consumer ``consumer`` of ``consumers`` yields after ``consumed`` are done."""
    if not 0 <= consumer < consumers:
        raise ValueError(f"consumer {consumer} is not in 0..{consumers - 1}")
    remaining = order[min(max(consumed, 0), len(order)):]
    if not len(remaining):
        return remaining
    per_consumer = -(-len(remaining) // consumers)
    padded = np.resize(remaining, per_consumer * consumers)   # wraps around: duplicates pad the tail
    return padded[consumer::consumers]
