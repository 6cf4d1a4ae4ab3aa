"""Failures ESS cannot see: completions that drift in length or truncation while every ratio stays near 1.

ESS compares the trainer with the engine that sampled; when the policy itself degenerates (answers that ramble
until ``max_new_tokens`` and get cut, or collapse to a few tokens), trainer and engine still agree and ESS stays
near 1 (marin #8955: minimum ESS 0.989 while 98% of answers were truncated). `DriftWatch` compares each step's
truncation rate and mean completion length, averaged over the last ``window`` steps, with their level over the
first ``window`` steps, and warns once per signal, in the log and in MLflow (the metric ``signals/<name>`` = 1
at the step it fired, and a run tag ``trustbatch.signal.<name>`` holding the message), when one moves far from
its early level while the step's ESS is at least ``ess_near_one``. Far is:

- truncation: the rate rose by at least ``truncation_rise`` (absolute; 0.25: a quarter more of all answers cut);
- length: the mean moved by a factor of at least ``length_factor`` either way (2: doubled, or halved).

Pure bookkeeping over the step metrics the loop already logs (`rollout/truncated_frac`,
`rollout/response_len/mean`, `loss/ess`); it never stops a run. The glossary is in trainer/README.md.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

SIGNALS = {"truncation": "rollout/truncated_frac", "length": "rollout/response_len/mean"}


@dataclass
class DriftWatch:
    window: int = 5
    truncation_rise: float = 0.25
    length_factor: float = 2.0
    ess_near_one: float = 0.95
    fired: dict[str, int] = field(default_factory=dict)
    """Signal name -> the step at which it fired (each fires at most once a run)."""
    _rows: list[dict[str, float]] = field(default_factory=list)

    def observe(self, step: int, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Take one step's metrics; returns (signal, message) for each signal that fires at this step."""
        self._rows.append({key: float(metrics[key]) for key in (*SIGNALS.values(), "loss/ess") if key in metrics})
        if len(self._rows) < 2 * self.window or metrics.get("loss/ess", 0.0) < self.ess_near_one:
            return []
        out = []
        for name, key in SIGNALS.items():
            if name in self.fired:
                continue
            early = self._mean(key, self._rows[: self.window])
            recent = self._mean(key, self._rows[-self.window :])
            if early is None or recent is None or not self._far(name, early, recent):
                continue
            self.fired[name] = step
            out.append((name, (
                f"step {step}: {key} moved from {early:.3g} (its mean over the first {self.window} steps) to {recent:.3g} "
                f"(over the last {self.window}) while ESS is {metrics['loss/ess']:.3f}: ESS compares the trainer with the "
                "engine, and both changed together; look at the completions (the policy may be degenerating)"
            )))  # fmt: skip
        return out

    def _far(self, name: str, early: float, recent: float) -> bool:
        if name == "truncation":
            return recent - early >= self.truncation_rise
        if early <= 0 or recent <= 0:
            return early != recent
        return max(recent / early, early / recent) >= self.length_factor

    @staticmethod
    def _mean(key: str, rows: list[dict[str, float]]) -> float | None:
        values = [row[key] for row in rows if key in row]
        return statistics.fmean(values) if values else None
