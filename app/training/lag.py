"""The lag bound in force: a fixed `rollout.max_lag`, or one chosen at run time from the measured ESS.

`rollout.max_lag: auto` lets the run decide how far generation may run ahead of training. The ESS of a step
(trainer/README.md) measures how far the policy has moved from the policies that generated its samples: it
falls as the lag grows, and how fast depends on the learning rate, the model and the task, which is why a
fixed lag is a guess. The rule, after every step, with the step's ESS `e` and the floor `rollout.min_ess`:

- `e < min_ess`: the bound drops by one at once (not below 0, the synchronous loop);
- `e >= min_ess` on each of the last `PATIENCE` steps since the bound last changed: it rises by one (not
  above `rollout.max_auto_lag`).

So the bound backs off on the first step that is too far off-policy, and is raised only after a run of
steps that all stayed above the floor at the current bound. A new run starts at 0 (synchronous); a resumed
run continues from the bound its checkpoint recorded. Every rank sees the same (globally reduced) ESS, so
every rank's bound is the same.

The bound limits which tickets may start (`ticket_gate` in app/training/buffer.py); groups already
generated under a larger bound are still trained, up to `max_auto_lag`, so lowering the bound wastes no
samples. Pure logic: no asyncio, no torch.
"""

from __future__ import annotations

import math

PATIENCE = 4
"""Steps in a row at or above the floor before the bound rises by one."""


class LagBound:
    """The largest policy lag new tickets may be generated at; `observe` each step's ESS to move it."""

    def __init__(self, fixed: int | None, *, min_ess: float = 0.9, limit: int = 8, start: int = 0) -> None:
        """`fixed`: a constant bound (`rollout.max_lag = k`), or None for the ESS-driven bound in [0, limit]."""
        if fixed is not None and fixed < 0:
            raise ValueError(f"a fixed lag bound must be >= 0, got {fixed}")
        if not 0.0 < min_ess <= 1.0:
            raise ValueError(f"min_ess={min_ess} must be in (0, 1]")
        if limit < 0:
            raise ValueError(f"limit={limit} must be >= 0")
        self.fixed, self.min_ess, self.limit = fixed, min_ess, limit
        self.value = fixed if fixed is not None else min(max(int(start), 0), limit)
        self._above = 0  # steps in a row at or above the floor since the bound last changed
        self.changes = 0

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def observe(self, ess: float) -> int:
        """Move the bound after a step whose ESS was `ess`; returns the bound for the next tickets.

        A non-finite ESS (a skipped step) leaves the bound and the count of good steps where they are.
        """
        if self.fixed is not None or not math.isfinite(ess):
            return self.value
        if ess < self.min_ess:
            self._above = 0
            if self.value > 0:
                self.value -= 1
                self.changes += 1
            return self.value
        self._above += 1
        if self._above >= PATIENCE and self.value < self.limit:
            self.value += 1
            self.changes += 1
            self._above = 0
        return self.value
