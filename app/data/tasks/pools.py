"""Drawing distinct problems from per-template pools, shared by the template-table tasks (word_problems,
python_functions): a template uniformly among those with problems left, then one of its problems not yet drawn."""

from __future__ import annotations

import random
from collections.abc import Iterator


def draw_problems(pool_sizes: list[int], rng: random.Random) -> Iterator[tuple[int, int]]:
    """(pool, item) pairs until every pool is used up: the pool uniformly among those with items left, the item
    uniformly among that pool's items not yet drawn (a lazy Fisher-Yates shuffle of each pool).

    Lazy, so a caller may use `rng` between draws: the sequence depends only on the seed and on what the caller
    draws in between, and a longer run extends a shorter one."""
    taken = [0] * len(pool_sizes)
    moved: list[dict[int, int]] = [{} for _ in pool_sizes]
    open_pools = [i for i, size in enumerate(pool_sizes) if size]
    while open_pools:
        i = rng.choice(open_pools)
        k, size = taken[i], pool_sizes[i]
        j = rng.randrange(k, size)
        index = moved[i].get(j, j)
        moved[i][j] = moved[i].get(k, k)
        taken[i] = k + 1
        if taken[i] == size:
            open_pools.remove(i)
        yield i, index
