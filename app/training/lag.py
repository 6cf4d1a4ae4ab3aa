"""The lag bound in force: a fixed `rollout.max_lag`, or one chosen at run time from the measured ESS.

`rollout.max_lag: auto` lets the run decide how far generation may run ahead of training. The ESS of a step
(trainer/README.md) measures how far the policy has moved from the policies that generated its samples: it
falls as the lag grows, and how fast depends on the learning rate, the model and the task, which is why a
fixed lag is a guess. Each ticket is issued under the bound in force when the producer reaches it, and a
step's samples come from tickets issued a few steps earlier, so every step reports the bound its tickets were
issued under (`rollout/max_lag`) and the rule reads a step only for the bound it measured. After every step,
with the step's ESS `e`, the floor `rollout.min_ess` and the bound in force `B`:

- a step issued under a bound above `B` (from before the last drop) is ignored: it measured a bound no longer
  in force, and counting it would drop the bound again for the same cause;
- `e < min_ess`: the bound drops by one at once (not below 0, the synchronous loop);
- `e >= min_ess` on `PATIENCE` steps issued under `B` itself since the bound last changed: it rises by one (not
  above `rollout.max_auto_lag`). Steps issued under a lower bound (from before the last raise) neither count
  nor reset the count.
- a skipped step (non-finite loss: its ESS means nothing) changes nothing.

So the bound backs off on the first step that is too far off-policy, and is raised only after a run of steps
measured at the current bound that all stayed above the floor. A new run starts at 0 (synchronous); a resumed
run continues from the bound its checkpoint recorded (and counts good steps afresh). Every rank sees the same
(globally reduced) ESS and issued bound, so every rank's bound is the same.

The ESS read is `loss/ess`, whatever `trainer.ess_scope`: with `sequence` it is the token-weighted mean of
the sequences' own ESS, which runs higher than one ESS over a micro-batch, so the same floor is looser there.
The bound limits which tickets may start (`ticket_gate` in app/training/buffer.py); groups already generated
under a larger bound are still trained, up to `max_auto_lag`, so lowering the bound wastes no samples. Pure
logic: no asyncio, no torch.
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

    def observe(self, ess: float, *, issued_under: int | None = None) -> int:
        """Move the bound after a step whose ESS was `ess`; returns the bound for the next tickets.

        `issued_under`: the largest bound the step's tickets were issued under (None: the current one). A
        non-finite ESS (pass NaN for a skipped step) leaves the bound and the count where they are.
        """
        if self.fixed is not None or not math.isfinite(ess):
            return self.value
        issued = self.value if issued_under is None else issued_under
        if issued > self.value:  # measured a bound dropped since: already acted on
            return self.value
        if ess < self.min_ess:
            self._above = 0
            if self.value > 0:
                self.value -= 1
                self.changes += 1
            return self.value
        if issued < self.value:  # measured the bound before the last raise: says nothing about this one
            return self.value
        self._above += 1
        if self._above >= PATIENCE and self.value < self.limit:
            self.value += 1
            self.changes += 1
            self._above = 0
        return self.value
