"""Overlay lag sweeps: gain against forced lag for cells of several `lag_sweep.py` results in one plot.

    .venv/bin/python bench/plot_sweeps.py OUT.png LABEL=RESULTS_JSON[:OBJECTIVE] ...

Each argument draws one line: the cells of OBJECTIVE (default ess) in RESULTS_JSON (a `lag_sweep.json`), as the
mean gain ± across-seed SE at each k. The variant comparison in bench/README.md is

    .venv/bin/python bench/plot_sweeps.py bench/plots/lag_variants.png \\
        "k3 (default)=bench/results/sweep/grid/lag_sweep.json" \\
        "ppo_clip=bench/results/sweep/grid/lag_sweep.json:ppo_clip" \\
        "k3_capped=bench/results/sweep/k3_capped/lag_sweep.json" "ess_scope=step=bench/results/sweep/step/lag_sweep.json"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def draw_gain_against_lag(ax, lines: list[tuple[str, list[dict]]], ylabel: str) -> None:
    """On `ax`: one line per (label, table rows of `lag_sweep.py`), mean gain ± across-seed SE against k."""
    lags = sorted({r["lag"] for _, rows in lines for r in rows})
    for label, rows in lines:
        rows = sorted(rows, key=lambda r: r["lag"])
        ax.errorbar([r["lag"] for r in rows], [100 * r["gain"] for r in rows],
                    yerr=[100 * r["gain_seed_se"] for r in rows], marker="o", capsize=3, label=label)  # fmt: skip
    ax.axhline(0, color="#999", lw=0.8)
    ax.set_xscale("symlog", base=2)
    ax.set_xticks(lags, [str(k) for k in lags])
    ax.set_xlabel("forced policy lag k")
    ax.set_ylabel(ylabel)
    ax.set_title("gain against lag (± across-seed SE)")
    ax.legend(fontsize=8)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    lines = []
    for spec in argv[1:]:
        label, _, source = spec.rpartition("=")
        path, _, objective = source.partition(":")
        table = json.loads(Path(path).read_text())["table"]
        rows = [r for r in table if r["objective"] == (objective or "ess")]
        if not rows:
            print(f"no {objective or 'ess'} cells in {path}", file=sys.stderr)
            return 2
        lines.append((label, rows))
    draw_gain_against_lag(ax, lines, "gain in held-out pass@1 (points)")
    fig.tight_layout()
    fig.savefig(argv[0], dpi=100)
    plt.close(fig)
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
