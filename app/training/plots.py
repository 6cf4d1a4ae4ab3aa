"""The run's PNG: reward, held-out accuracy and ESS per step."""

from __future__ import annotations

from pathlib import Path


def plot_run(history: list[dict[str, float]], evals: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    tools = bool(history) and "tools/calls_per_trajectory" in history[0]
    fig, axes = plt.subplots(1, 5 if tools else 3, figsize=(25 if tools else 15, 4))
    rewards = [h["reward/mean"] for h in history]
    axes[0].plot(steps, rewards, lw=0.6, alpha=0.4, label="train reward (step mean)")
    window = max(1, len(rewards) // 30)
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    axes[0].plot(steps, smooth, lw=1.5, label=f"moving average ({window} steps)")
    axes[0].set_title("reward")
    axes[0].set_xlabel("step")
    axes[0].legend()

    eval_steps = [e["step"] for e in evals]
    acc = [100 * e["eval/accuracy"] for e in evals]
    se = [100 * e["eval/accuracy_se"] for e in evals]
    axes[1].errorbar(eval_steps, acc, yerr=se, marker="o", capsize=3, label="sampled pass@1 (train T)")
    if evals and "eval/greedy_accuracy" in evals[0]:
        axes[1].plot(eval_steps, [100 * e["eval/greedy_accuracy"] for e in evals], marker="s", label="greedy")
    axes[1].set_title("held-out accuracy (%)")
    axes[1].set_xlabel("step")
    handles, labels = axes[1].get_legend_handles_labels()
    if evals and all("eval/answer_rate" in e for e in evals):
        # Its own axis: near 100% (the tiny model) it would squash the accuracy curves into the bottom.
        right = axes[1].twinx()
        right.plot(eval_steps, [100 * e["eval/answer_rate"] for e in evals], marker="^", ls="--", color="tab:green",
                   label="answer found (format, sampled; right axis)")  # fmt: skip
        right.set_ylabel("answer found (%)")
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    # One legend below the axes: inside, wherever it went, some run's curve ran under it.
    axes[1].legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, frameon=False)

    ess = [h["loss/ess"] for h in history]
    axes[2].plot(steps, ess, lw=1, label="ESS")
    low = min(ess, default=1.0)
    axes[2].set_ylim(
        max(0.0, low - 0.1 * (1.0 - low) - 1e-3), 1.0 + 1e-3
    )  # 1.0 on-policy: show the small dips
    axes[2].set_title("normalised effective sample size")
    axes[2].set_xlabel("step")
    axes[2].legend()

    if tools:
        _plot_tools(axes[3], axes[4], history, steps)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")  # keeps the legend below the axes
    plt.close(fig)


def _plot_tools(calls_ax, turns_ax, history: list[dict[str, float]], steps: list[float]) -> None:
    """Tool runs (docs/tools.md): calls, errors and statuses per step; each turn's engine-trainer logprob gap."""
    calls_ax.plot(steps, [h["tools/calls_per_trajectory"] for h in history], lw=1, label="tool calls / answer")
    calls_ax.plot(steps, [h["rollout/turns/mean"] for h in history], lw=1, label="turns / answer")
    for key, style in (("tools/error_rate", "--"), ("rollout/void_turn_rate", ":"), ("rollout/status/budget", "-."),
                       ("rollout/status/max_turns", (0, (1, 1)))):  # fmt: skip
        calls_ax.plot(steps, [h.get(key, 0.0) for h in history], lw=1, ls=style, label=key.rpartition("/")[2] + " (share)")
    calls_ax.set_title("tools")
    calls_ax.set_xlabel("step")
    calls_ax.legend(fontsize=7)
    for k in range(4):
        key = f"loss/logprob_gap_turn/{k}"
        points = [(s, h[key]) for s, h in zip(steps, history, strict=True) if key in h]
        if points:
            turns_ax.plot(*zip(*points, strict=True), lw=1, label=f"turn {k}{'+' if k == 3 else ''}")
    turns_ax.set_title("engine-trainer |logprob gap| per turn (nats/token)")
    turns_ax.set_xlabel("step")
    turns_ax.legend(fontsize=7)
