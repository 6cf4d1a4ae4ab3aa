"""The run's PNG: reward, held-out accuracy and ESS per step."""

from __future__ import annotations

from pathlib import Path


def plot_run(history: list[dict[str, float]], evals: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [h["reward/mean"] for h in history], lw=1, label="train reward (mean)")
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
    axes[1].legend()

    axes[2].plot(steps, [h["loss/ess"] for h in history], lw=1, label="ESS")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_title("normalised effective sample size")
    axes[2].set_xlabel("step")
    axes[2].legend()

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
