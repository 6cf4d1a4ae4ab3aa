"""The order training examples are drawn in: seeded epochs, resumable from a position, with an online filter.

`PromptSampler` gives RL its prompts (app/training/loop.py) and `trustbatch sft` its examples
(app/training/sft_loop.py).
"""

from __future__ import annotations

import random


class PromptSampler:
    """Seeded epochs over the training prompts; `cursor` is the data position (for resumption).

    With ``skip_decided`` (rollout.skip_decided) > 0, a prompt reported `decided` (its latest group all right or
    all wrong) is passed over its next ``skip_decided`` draws; `skipped` counts the draws passed over. Never
    more than one epoch of passes in one `take`, so a run whose prompts are all decided still gets prompts.
    """

    def __init__(self, size: int, seed: int, cursor: int = 0, skip_decided: int = 0):
        self.size, self.seed, self.cursor, self.skip_decided = size, seed, cursor, skip_decided
        self.skip_left: dict[int, int] = {}
        self.skipped = 0
        self._epoch: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._epoch[0] != epoch:
            order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        passes = 0
        while len(out) < k:
            epoch, offset = divmod(self.cursor, self.size)
            index = self._order(epoch)[offset]
            self.cursor += 1
            left = self.skip_left.get(index, 0)
            if left and passes < self.size:
                passes += 1
                self.skipped += 1
                if left == 1:
                    del self.skip_left[index]
                else:
                    self.skip_left[index] = left - 1
                continue
            out.append(index)
        return out

    def decided(self, index: int, decided: bool) -> None:
        """Report prompt ``index``'s latest group: all right or all wrong (``decided``), or mixed."""
        if not self.skip_decided:
            return
        if decided:
            self.skip_left[index] = self.skip_decided
        else:
            self.skip_left.pop(index, None)


class MixtureSampler:
    """A weighted mixture of sources (``data.train`` as a list): each draw picks a source in proportion to its
    weight, then that source's next prompt in its own seeded epochs (`PromptSampler`). Deterministic for a seed, and
    resumable: the draw count is the cursor (the sources' own positions are replayed from it).

    ``groups[s]`` are the indices (into the run's prompt list) of source s; a source with no row or weight 0 is
    never drawn. ``skip_decided`` works per source, as in `PromptSampler`."""

    def __init__(self, groups: list[list[int]], weights: list[float], seed: int, cursor: int = 0,
                 skip_decided: int = 0) -> None:  # fmt: skip
        if len(groups) != len(weights):
            raise ValueError(f"{len(groups)} sources but {len(weights)} weights")
        live = [s for s, (g, w) in enumerate(zip(groups, weights, strict=True)) if g and w > 0]
        if not live:
            raise ValueError("no source of the mixture has both rows and a weight > 0")
        self.groups, self.seed = groups, seed
        self._live = live
        self._weights = [weights[s] for s in live]
        self._rng = random.Random(f"mixture:{seed}")
        self._samplers = [PromptSampler(len(g), seed * 7919 + s, skip_decided=skip_decided) for s, g in enumerate(groups)]
        self._where = {index: (s, k) for s, group in enumerate(groups) for k, index in enumerate(group)}
        self.cursor = 0
        if cursor:
            self.take(cursor)  # replay: the same draws land every source where it was
            for sampler in self._samplers:
                sampler.skipped = 0

    @property
    def skipped(self) -> int:
        return sum(sampler.skipped for sampler in self._samplers)

    def take(self, k: int) -> list[int]:
        out = []
        for source in self._rng.choices(self._live, weights=self._weights, k=k):
            [local] = self._samplers[source].take(1)
            out.append(self.groups[source][local])
        self.cursor += k
        return out

    def decided(self, index: int, decided: bool) -> None:
        source, local = self._where[index]
        self._samplers[source].decided(local, decided)
