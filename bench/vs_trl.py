"""trustbatch against Hugging Face TRL's GRPOTrainer, at equal training wall time, on one of two tasks.

`--task quickstart` (default): the quickstart's warm-started tiny model on builtin:arithmetic
(configs/quickstart.yaml). `--task smollm2-code`: SmolLM2-135M-Instruct writing short Python functions
(configs/smollm2-code.yaml, `make smollm2` first), rewarded by trustbatch's `code` verifier in its sandbox, which
TRL's reward function calls too (Docker where an engine runs, else bubblewrap: `backend: auto`).

For each seed, one run after another on this machine (never in parallel): `trustbatch train <config>
run.time_limit_s=T` (asynchronous, max_lag 1, the ESS objective), then TRL 1.16.0's `GRPOTrainer`
(bench/trl_worker.py, in its own virtualenv .venv-trl built by bench/trl_env/build.sh) for the same T seconds of
training, both from the same starting model. Both final models, and the starting model once, are then scored by
the same command, `trustbatch eval`, side by side (one process and one thread each; evaluations are seeded and
untimed): held-out sampled pass@1 on the task's test split (quickstart: 1500 prompts x 4 samples, 8 new tokens;
smollm2-code: 200 functions never trained on x 4 samples, 160 new tokens, correct = all its tests pass),
temperature 1.0, sampling seed 0, so every model is sampled with the same random streams. Prints a table
(steps, completions/s, pass@1 start → end, gain ± SE paired by prompt), the mean over seeds ± the across-seed
SE per system, the completions/s ratio trustbatch/TRL and the gain difference paired by seed; writes
bench/results/vs_trl.json (smollm2-code: vs_trl-smollm2-code.json) and a plot beside it.

    bash bench/trl_env/build.sh                     (run by this script too; a no-op when up to date)
    .venv/bin/python bench/vs_trl.py [--task quickstart|smollm2-code] [--seconds 300] [--seeds 0 1 2]
        [--trl-threads 2] [--quick]

The list below was written for the quickstart; what differs on smollm2-code: chat prompts (TRL renders them with
the chat template; the worker checks they are the ids trustbatch's engines get), 4 prompts x 8 completions a
step, at most 160 new tokens, lr 2e-5, advantages not divided by the group std (scale_rewards="none"), rewards
the fraction of a function's 3 tests passed, 2 reward workers on each side (TRL: a 2-thread pool inside its
reward function), and trustbatch without shared prompts (the config's default).

Matched (TRL's side read from trl/trainer/grpo_trainer.py and grpo_config.py of trl 1.16.0):
- Model: the same warm-started directory (a fresh copy for TRL), trained in float32 on both sides. TRL's
  defaults bf16=True (autocast) and gradient checkpointing on are turned off.
- Prompts: the builtin:arithmetic train split (the 20,000 rows `trustbatch train` generates), written to JSONL
  by this script. TRL tokenizes a plain prompt with the tokenizer's defaults; the worker checks that these are
  the ids trustbatch's engines get (no special tokens added).
- Reward: trustbatch's own `math` verifier with the config's params (numeric_answer: true), a sample it cannot
  judge scoring rewards.error_reward (0), called in-process by TRL's reward function.
- Batch: 32 prompts x 8 completions = 256 completions per optimizer step, each used for one step: TRL's
  per_device_train_batch_size is counted in completions, so it is 256 with gradient_accumulation_steps=1,
  hence steps_per_generation=1 and one generation batch per optimizer step; num_iterations=1.
- Sampling: temperature 1.0, top_p 1.0, no top-k, at most 8 new tokens, stopping at EOS and <|im_end|> (the
  worker declares both in the model's generation_config, where GRPOTrainer takes its stop ids from).
- Advantages: (reward − group mean) / (group std + eps), the std Bessel-corrected on both sides
  (scale_rewards="group"; eps is 1e-4 in TRL, 1e-6 in trustbatch). No KL penalty: beta=0, so TRL loads no
  reference model (trustbatch's objective.ref_kl_coef is 0).
- Optimizer: AdamW, lr 3e-5 constant (TRL's default linear decay replaced), no warm-up, betas (0.9, 0.999),
  eps 1e-8, no weight decay, gradients clipped at norm 1.0.
- Loss normalisation: token-level on both sides: TRL's loss_type="dapo" divides the summed token losses by
  the number of completion tokens of the generation batch, trustbatch by the number of tokens it trains on.
- Time: each stops after the first optimizer step that ends T seconds of training wall time after it began
  (trustbatch: run.time_limit_s, evaluations excluded; TRL: a TrainerCallback from on_train_begin, model
  loading excluded). completions/s = completions the trainer consumed / that training wall time.
- Evaluation: the same `trustbatch eval` command, prompts, samples, temperature and seed for every model.

Not matched (what each system is):
- Generation: TRL without vLLM generates inside its training step with transformers `generate` on the
  training model itself, one left-padded batch of all 256 sequences (the worker records the size and time of
  every call), and scores in the same process: training waits for generation and generation for training.
  trustbatch generates in a separate rollout-server process while the trainer trains (max_lag 1), so its
  samples are up to one policy version old, and scores them in a reward-worker process.
- Cores: with one torch thread per process (trustbatch's default), trustbatch's trainer and rollout server
  use both cores, TRL's single process one. `--trl-threads 2` gives TRL both.
- Objective: trustbatch optimises the ESS objective on slightly stale samples; TRL's clipped surrogate sees
  a ratio of exactly 1 (old_per_token_logps = per_token_logps.detach() when steps_per_generation=1 and
  num_iterations=1, without vLLM), so it takes the plain on-policy policy gradient with GRPO advantages.
- Uninformative groups: trustbatch drops groups whose 8 rewards are equal (advantage.drop_zero_variance_groups)
  and normalises by the tokens of the rest; TRL keeps them with advantage 0: it still runs their forward and
  backward passes (about half of each batch here) and counts their tokens in the DAPO denominator, so its
  gradient is smaller by that share before clipping (clipping to norm 1.0 then bounds both updates).
- Shared prompts: trustbatch's trainer runs each group's prompt once and packs its 8 completions after it
  (trainer.share_prompts, on in the quickstart config; the same logprobs and gradients), about 2.5x fewer
  tokens through the model here; TRL runs 256 padded prompt + completion rows.
- Extra work in TRL's step: the loss forward also computes per-token entropies (for logging).
- Prompt order: TRL's RepeatSampler shuffles the dataset with the seed; trustbatch's PromptSampler draws
  seeded epochs: the same prompts in different orders, and different sampling random streams.

The 2-core machines are noisy and shared with whatever else runs: read ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, stdev
from typing import TYPE_CHECKING, Any

# The repo root first: bench/ (this script's folder, first on sys.path) has a rewards.py that would shadow the
# `rewards` package that app.config imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.training_runs import REPO, machine, mean_se, train  # noqa: E402

if TYPE_CHECKING:
    from app.config import Config

TRL_ENV_BUILD = REPO / "bench" / "trl_env" / "build.sh"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
TRL_WORKER = REPO / "bench" / "trl_worker.py"
EVAL_SEED = 0
"""Sampling seed of every evaluation: all models are sampled with the same random streams."""


@dataclass(frozen=True)
class Task:
    """One setup both systems train on: trustbatch's config and what the comparison needs of it."""

    name: str
    config: Path
    verifier: str
    """The config's one verifier, which TRL's reward function calls in-process."""
    train_source: str
    """data.train the TRL worker reproduces (written to JSONL by this script)."""
    seconds: float
    """Default training wall time per run."""
    eval_prompts: int
    """Default held-out prompts."""
    in_run_eval: tuple[str, ...] = ()
    """Overrides of trustbatch's own before/after evaluation (its time is outside the limit, but not free)."""
    setup: str = ""
    """How a fresh machine gets the task's model, when the script cannot build it."""


TASKS = {
    "quickstart": Task("quickstart", REPO / "configs" / "quickstart.yaml", "math", "builtin:arithmetic", 300.0, 1500),
    "smollm2-code": Task(
        "smollm2-code", REPO / "configs" / "smollm2-code.yaml", "code", "builtin:python_functions", 480.0, 200,
        # trustbatch eval scores the final models below; the run's own evaluation only needs to exist.
        in_run_eval=("eval.num_prompts=8", "eval.samples_per_prompt=1", "eval.greedy=false"),
        setup="make smollm2",
    ),
}  # fmt: skip


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_logged(command: list[str], log: Path) -> None:
    """Run a child process with its output in `log`; a failure raises with the end of the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        code = subprocess.call(command, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited with {code}; end of {log}:\n{log.read_text()[-3000:]}"
        )


# ---------------------------------------------------------------------------------------------- setup


def task_config(task: Task) -> Config:
    from app.config import load_config

    cfg = load_config(task.config, [])
    # What the TRL worker reproduces; a config that changed any of these would no longer be compared like for like.
    checks = {
        "optim.schedule == constant": cfg.optim.schedule == "constant",
        "optim.warmup_steps == 0": cfg.optim.warmup_steps == 0,
        "optim.weight_decay == 0": cfg.optim.weight_decay == 0,
        "AdamW betas (0.9, 0.999), eps 1e-8": (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps)
        == (0.9, 0.999, 1e-8),
        "objective.ref_kl_coef == 0": cfg.objective.ref_kl_coef == 0,
        f"one verifier, {task.verifier}": [v.name for v in cfg.rewards.verifiers] == [task.verifier],
        f"data.train == {task.train_source}": cfg.data.train == task.train_source,
    }
    broken = [name for name, ok in checks.items() if not ok]
    if broken:
        raise SystemExit(f"{task.config} no longer matches what bench/trl_worker.py reproduces: {broken}")
    return cfg


def ensure_trl_env() -> None:
    """Build (or check) .venv-trl; the script is idempotent and prints one line when up to date."""
    code = subprocess.call(["bash", str(TRL_ENV_BUILD)], cwd=REPO, env=child_env())
    if code != 0:
        raise SystemExit(f"bash {TRL_ENV_BUILD.relative_to(REPO)} failed (exit {code}); see its output above")


def ensure_model(task: Task, cfg: Config, log: Path) -> Path:
    """The task's starting model: the quickstart's warm-started one is bootstrapped as `trustbatch train` would
    if it is missing; another must already be on disk (`task.setup` puts it there)."""
    path = Path(cfg.model.path)
    path = path if path.is_absolute() else REPO / path
    if not (path / "config.json").is_file():
        if not task.setup:
            print(f"bootstrapping the warm-started tiny model at {path} ...", flush=True)
            run_logged([sys.executable, "-m", "app.cli", "bootstrap", str(task.config)], log)
        else:
            raise SystemExit(f"no model at {path} (model.path of {task.config.name}): run `{task.setup}` first")
    return path


def write_train_prompts(cfg: Config, model: Path, path: Path) -> int:
    """The rows `trustbatch train` trains on, as JSONL for the TRL worker: each prompt as TRL takes it (a
    string, or a chat it renders with the chat template), its reference and metadata as JSON text (so tests
    of any shape pass through `datasets` unchanged), and the token ids trustbatch's engines get for it."""
    from app.data import load_split
    from app.data.prepare import ModelText, encode_rows

    rows = load_split(cfg.data, "train")
    ids = encode_rows(ModelText.from_dir(model).tokenizer, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for row, prompt_ids in zip(rows, ids, strict=True):
            line = {
                "row_id": row.id,
                "prompt": row.prompt if row.prompt is not None else row.messages,
                "reference": json.dumps(row.answer if row.answer is not None else row.tests),
                "task": row.task,
                "metadata": json.dumps(row.metadata),
                "prompt_ids": prompt_ids,
            }
            out.write(json.dumps(line) + "\n")
    return len(rows)


def fresh_dir(path: Path) -> Path:
    """An empty directory: a leftover run directory would make `trustbatch train` resume it."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# ---------------------------------------------------------------------------------------------- training


def train_trustbatch(
    task: Task, seed: int, seconds: float, eval_prompts: int, root: Path, name: str = "trustbatch",
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    run_dir = fresh_dir(root / f"{name}-seed{seed}")
    result = train(
        task.config,
        run_dir,
        [
            f"run.time_limit_s={seconds}",
            "run.steps=100000",  # the time limit decides
            f"run.seed={seed}",
            "eval.every=0",  # held-out evaluation before the first step and after the last only
            "checkpoint.every=0",  # the final checkpoint only: it holds the model evaluated below
            f"eval.num_prompts={eval_prompts}",
            "tracking.log_model=false",
            *task.in_run_eval,
            *extra,
        ],
        log=root / f"{name}-seed{seed}.log",
    )
    s = result["summary"]
    model = Path(s["checkpoint_dir"])
    return {
        "steps": s["steps"],
        "completions": s["train_samples"],
        "train_s": s["train_wall_s"],
        "completions_per_s": s["samples_per_s"],
        "mean_policy_lag": s["mean_policy_lag"],
        "in_run_eval": {
            "start": s["initial_accuracy"],
            "end": s["final_accuracy"],
            "gain": s["accuracy_gain"],
        },
        "model_dir": str(model if model.is_absolute() else REPO / model),
    }


def train_trl(
    task: Task, cfg: Config, seed: int, seconds: float, threads: int, bf16: bool, prompts: Path, model: Path,
    root: Path,
) -> dict:  # fmt: skip
    out = fresh_dir(root / f"trl-seed{seed}")
    start_model = out / "start-model"
    shutil.copytree(model, start_model)  # a fresh copy: nothing TRL does can touch the shared model
    from app.scoring import rewards_with_sandbox

    # The verifier's params as trustbatch's reward workers get them (the code verifier: with the config's sandbox).
    params = rewards_with_sandbox(cfg.rewards, cfg.sandbox).verifiers[0].params
    command = [
        str(TRL_PYTHON), str(TRL_WORKER),
        "--model", str(start_model), "--prompts", str(prompts), "--out", str(out),
        "--seconds", str(seconds), "--seed", str(seed), "--threads", str(threads),
        "--prompts-per-step", str(cfg.rollout.prompts_per_step), "--group-size", str(cfg.rollout.group_size),
        "--lr", str(cfg.optim.lr), "--max-grad-norm", str(cfg.trainer.max_grad_norm),
        "--temperature", str(cfg.rollout.temperature), "--top-p", str(cfg.rollout.top_p),
        "--max-new-tokens", str(cfg.rollout.max_new_tokens),
        "--scale-by-std" if cfg.advantage.scale_by_std else "--no-scale-by-std",
        "--verifier", task.verifier, "--verifier-params", json.dumps(dict(params)),
        "--error-reward", str(cfg.rewards.error_reward), "--reward-workers", str(cfg.rewards.num_workers),
        *(["--bf16"] if bf16 else []),
    ]  # fmt: skip
    run_logged(command, out / "worker.log")
    return json.loads((out / "result.json").read_text())


# ---------------------------------------------------------------------------------------------- evaluation


def eval_command(
    task: Task, model_dir: Path, cfg: Config, eval_prompts: int, samples: int, dtype: str, out: Path
) -> list[str]:
    return [
        sys.executable, "-m", "app.cli", "eval", str(model_dir),
        "--config", str(task.config), "--data", cfg.data.eval,
        "--num-prompts", str(eval_prompts), "--samples", str(samples), "--k", "1",
        "--temperature", str(cfg.rollout.temperature), "--max-new-tokens", str(cfg.rollout.max_new_tokens),
        "--seed", str(EVAL_SEED), "--dtype", dtype, "--threads", "1", "--no-track", "--out", str(out),
    ]  # fmt: skip


def evaluate(task: Task, models: dict[str, Path], cfg: Config, eval_prompts: int, samples: int, dtype: str,
             root: Path, suffix: str = "") -> dict[str, dict[str, Any]]:  # fmt: skip
    """`trustbatch eval` of each model, one process (one thread) each, at the same time: evaluations are not
    timed and each is seeded, so running them side by side changes their wall time, not their results. Returns
    each model's per-prompt accuracies (for paired gains) and pass@1 ± SE."""
    outs = {name: root / f"eval-{name}{suffix}.json" for name in models}
    running = []
    for name, model_dir in models.items():
        log = open(outs[name].with_suffix(".log"), "w")  # noqa: SIM115 - closed below, after the process ends
        command = eval_command(task, model_dir, cfg, eval_prompts, samples, dtype, outs[name])
        process = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        running.append((command, log, process))
    for command, log, process in running:
        code = process.wait()
        log.close()
        if code != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited with {code}; end of its log:\n{Path(log.name).read_text()[-3000:]}"
            )
    return {name: read_eval(out) for name, out in outs.items()}


def read_eval(out: Path) -> dict[str, Any]:
    report = json.loads(out.read_text())
    return {
        "ids": [p["id"] for p in report["prompts"]],
        "per_prompt": [p["correct"] / p["samples"] for p in report["prompts"]],
        "pass@1": report["metrics"]["pass@1"]["value"],
        "pass@1_se": report["metrics"]["pass@1"]["stderr"],
    }


def paired_diff(before: dict, after: dict) -> tuple[float, float]:
    """Mean per-prompt difference after − before ± its SE (prompts are the unit: their samples correlate)."""
    if before["ids"] != after["ids"]:
        raise RuntimeError("the two evaluations did not score the same prompts in the same order")
    return mean_se([a - b for a, b in zip(after["per_prompt"], before["per_prompt"], strict=True)])


# ---------------------------------------------------------------------------------------------- report


def pts(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.2f}"


def se_pts(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.2f}"


def summarize(runs: list[dict]) -> dict[str, Any]:
    systems = {}
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        gain, gain_se = mean_se([r["gain"] for r in mine])
        rate, rate_se = mean_se([r["completions_per_s"] for r in mine])
        systems[system] = {
            "gain": gain,
            "gain_se_across_seeds": gain_se,
            "completions_per_s": rate,
            "completions_per_s_se": rate_se,
            "steps": mean([r["steps"] for r in mine]),
            "final_pass@1": mean([r["end"] for r in mine]),
        }
    by_seed = {(r["system"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    diff = diff_se = ratio = math.nan  # without a TRL run (--no-trl)
    if "trl" in systems:
        diff, diff_se = mean_se([by_seed["trustbatch", s]["gain"] - by_seed["trl", s]["gain"] for s in seeds])
        ratio = systems["trustbatch"]["completions_per_s"] / systems["trl"]["completions_per_s"]
    variants = {}
    for name in systems:
        if name not in ("trustbatch", "trl"):
            d, d_se = mean_se([by_seed["trustbatch", s]["gain"] - by_seed[name, s]["gain"] for s in seeds])
            variants[name] = {"gain_difference": d, "gain_difference_se_across_seeds": d_se}
    return {
        "systems": systems,
        "completions_per_s_ratio": ratio,
        "gain_difference": diff,
        "gain_difference_se_across_seeds": diff_se,
        "variants": variants,
    }


def print_report(start: dict, runs: list[dict], summary: dict, eval_prompts: int, samples: int) -> None:
    print(
        f"\nheld-out sampled pass@1 ({eval_prompts} prompts x {samples} samples; start {100 * start['pass@1']:.2f}% "
        f"± {100 * start['pass@1_se']:.2f}); gains in points, SE paired by prompt"
    )
    header = (
        f"{'system':<11}{'seed':>5}{'steps':>7}{'compl/s':>9}  {'pass@1 start → end':<20}{'gain ± SE':>15}"
    )
    print(header + "\n" + "-" * len(header))
    for r in runs:
        change = f"{100 * r['start']:.2f}% → {100 * r['end']:.2f}%"
        gain = f"{pts(r['gain'])} ± {se_pts(r['gain_se'])}"
        print(
            f"{r['system']:<11}{r['seed']:>5}{r['steps']:>7}{r['completions_per_s']:>9.3g}  {change:<20}{gain:>15}"
        )
    print("\nmean over seeds ± across-seed SE:")
    for system, s in summary["systems"].items():
        print(
            f"  {system:<11} gain {pts(s['gain'])} ± {se_pts(s['gain_se_across_seeds'])}, "
            f"{s['completions_per_s']:.3g} completions/s, {s['steps']:.0f} steps"
        )
    if "trl" in summary["systems"]:
        print(f"  completions/s trustbatch / TRL: {summary['completions_per_s_ratio']:.2f}")
        print(
            f"  gain trustbatch − TRL (paired by seed): {pts(summary['gain_difference'])} ± "
            f"{se_pts(summary['gain_difference_se_across_seeds'])}"
        )
        for pair in summary["by_seed"]:
            print(
                f"    seed {pair['seed']}: {pts(pair['gain_difference'])} ± {se_pts(pair['se_by_prompt'])} "
                "(SE paired by prompt)"
            )
    for name, v in summary["variants"].items():
        print(
            f"  gain trustbatch − {name} (paired by seed): {pts(v['gain_difference'])} ± "
            f"{se_pts(v['gain_difference_se_across_seeds'])}"
        )
        for pair in summary["by_seed"]:
            d = pair[f"vs_{name}"]
            print(f"    seed {pair['seed']}: {pts(d['difference'])} ± {se_pts(d['se_by_prompt'])} (SE paired by prompt)")
    for r in runs:
        if r["system"] == "trl":
            d = r["details"]
            print(
                f"  TRL seed {r['seed']}: {d['completions_per_step']:.0f} completions per optimizer step, "
                f"generate calls of {d['sequences_per_generate_call']} sequences; of its training time "
                f"{d['generate_s'] / d['train_s']:.0%} in generate, {d['reward_s'] / d['train_s']:.0%} in rewards"
            )


# ---------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--task", choices=sorted(TASKS), default="quickstart",
        help="quickstart: the tiny model on arithmetic; smollm2-code: SmolLM2-135M-Instruct writing Python",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=float, help="training wall time per run (default 300, smollm2-code 480; --quick 60)"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="run.seed / TRL seed of each pair (default 0 1 2)"
    )
    parser.add_argument(
        "--eval-prompts", type=int, help="held-out prompts (default 1500, smollm2-code 200; --quick 300 or fewer)"
    )
    parser.add_argument(
        "--eval-samples", type=int, help="samples per held-out prompt (default: eval.samples_per_prompt)"
    )
    parser.add_argument("--trl-threads", type=int, default=1, help="torch threads of the TRL process")
    parser.add_argument(
        "--no-trl", action="store_true",
        help="train no TRL run: trustbatch against its --also variants only (e.g. ess against ppo_clip)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-dtype", choices=("float32", "bfloat16"), default="float32",
        help="compute dtype of every evaluation's engine (trustbatch eval --dtype); the same for all models",
    )  # fmt: skip
    parser.add_argument(
        "--trl-bf16", action="store_true",
        help="TRL with bf16=True: accelerate autocasts its model's forward (generation and training) to bfloat16 "
        "over float32 weights; pair it with --overrides rollout.dtype=bfloat16 trainer.compute_dtype=bfloat16",
    )  # fmt: skip
    parser.add_argument(
        "--overrides", nargs="+", default=[], metavar="KEY=VALUE",
        help="config overrides of the main trustbatch run (e.g. trainer.share_prompts=true)",
    )  # fmt: skip
    parser.add_argument("--name", default="", help="a suffix of the output files, so sittings do not overwrite")
    parser.add_argument(
        "--also", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="one more trustbatch run per seed with these overrides, scored beside the others "
        "(e.g. ppo_clip:objective.name=ppo_clip); repeatable",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a smoke run: 60 s, seed 0, 300 eval prompts")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--plot-only", action="store_true", help="redraw OUT/vs_trl.png from OUT/vs_trl.json")
    args = parser.parse_args()
    args.task = TASKS[args.task]
    if any("=" not in o for o in args.overrides):
        parser.error(f"--overrides {args.overrides}: expected KEY=VALUE items")
    also = []
    for spec in args.also:
        name, _, overrides = spec.partition(":")
        if not name or not overrides or name in ("trustbatch", "trl", "start") or "=" not in overrides:
            parser.error(f"--also {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE] with a new name")
        also.append((name, tuple(overrides.split(","))))
    args.also = also
    if args.no_trl and not also:
        parser.error("--no-trl needs at least one --also variant to compare trustbatch with")
    args.seconds = args.seconds or (60.0 if args.quick else args.task.seconds)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.eval_prompts = args.eval_prompts or (min(300, args.task.eval_prompts) if args.quick else args.task.eval_prompts)
    return args


@dataclass
class Shared:
    """What every seed's pair of runs shares."""

    root: Path
    """Run directories, logs and evaluation results."""
    model: Path
    """The warm-started starting model."""
    prompts: Path
    """The training prompts as JSONL, for the TRL worker."""
    samples: int
    """Samples per held-out prompt."""
    start: dict[str, Any]
    """The starting model's evaluation."""


def run_seed(seed: int, args: argparse.Namespace, cfg: Config, shared: Shared) -> tuple[list[dict], dict]:
    """Train both systems for one seed, one after the other, and evaluate both final models.

    Returns a row per system and the seed's gain difference trustbatch − TRL, paired by prompt (the two final
    models were sampled on the same prompts with the same seed)."""
    root, start, task = shared.root, shared.start, args.task
    print(f"seed {seed}: trustbatch, {args.seconds:g} s of training ...", flush=True)
    results = {
        "trustbatch": train_trustbatch(task, seed, args.seconds, args.eval_prompts, root, extra=tuple(args.overrides))
    }
    if not args.no_trl:
        print(f"seed {seed}: TRL GRPOTrainer, {args.seconds:g} s of training ...", flush=True)
        results["trl"] = train_trl(
            task, cfg, seed, args.seconds, args.trl_threads, args.trl_bf16, shared.prompts, shared.model, root
        )
    for name, overrides in args.also:
        print(f"seed {seed}: trustbatch with {' '.join(overrides)} ({name}), {args.seconds:g} s of training ...", flush=True)
        results[name] = train_trustbatch(task, seed, args.seconds, args.eval_prompts, root, name, overrides)
    print(f"seed {seed}: evaluating the final models ...", flush=True)
    models = {system: Path(result["model_dir"]) for system, result in results.items()}
    ends = evaluate(
        task, models, cfg, args.eval_prompts, shared.samples, args.eval_dtype, root, suffix=f"-seed{seed}"
    )
    rows = []
    for system, result in results.items():
        end = ends[system]
        gain, gain_se = paired_diff(start, end)
        rows.append({
            "system": system, "seed": seed, "steps": result["steps"], "completions": result["completions"],
            "train_s": result["train_s"], "completions_per_s": result["completions_per_s"],
            "start": start["pass@1"], "end": end["pass@1"], "end_se": end["pass@1_se"],
            "gain": gain, "gain_se": gain_se, "details": result,
        })  # fmt: skip
    pair: dict[str, Any] = {"seed": seed}
    if "trl" in ends:
        pair["gain_difference"], pair["se_by_prompt"] = paired_diff(ends["trl"], ends["trustbatch"])
    for name, _ in args.also:  # trustbatch (the config as written) − each variant, paired by prompt
        d, d_se = paired_diff(ends[name], ends["trustbatch"])
        pair[f"vs_{name}"] = {"difference": d, "se_by_prompt": d_se}
    return rows, pair


def main() -> int:
    args = parse_args()
    task: Task = args.task
    stem = ("vs_trl" if task.name == "quickstart" else f"vs_trl-{task.name}") + (f"-{args.name}" if args.name else "")
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    if args.plot_only:
        plot(json.loads(json_path.read_text()), png_path)
        print(f"wrote {png_path}")
        return 0
    cfg = task_config(task)
    root = args.out.resolve() / stem
    if not args.no_trl:
        ensure_trl_env()
    samples = args.eval_samples or cfg.eval.samples_per_prompt
    model = ensure_model(task, cfg, root / "bootstrap.log")
    prompts = root / "train_prompts.jsonl"
    print(f"{write_train_prompts(cfg, model, prompts)} training prompts written to {prompts}", flush=True)
    print("evaluating the starting model ...", flush=True)
    start = evaluate(task, {"start": model}, cfg, args.eval_prompts, samples, args.eval_dtype, root)["start"]
    shared = Shared(root=root, model=model, prompts=prompts, samples=samples, start=start)
    runs, pairs = [], []
    for seed in args.seeds:
        rows, pair = run_seed(seed, args, cfg, shared)
        runs += rows
        pairs.append(pair)

    summary = {**summarize(runs), "by_seed": pairs}
    print_report(start, runs, summary, args.eval_prompts, samples)
    report = {
        "machine": machine(),
        "settings": {
            "seconds": args.seconds,
            "seeds": args.seeds,
            "eval_prompts": args.eval_prompts,
            "eval_samples": samples,
            "eval_seed": EVAL_SEED,
            "eval_dtype": args.eval_dtype,
            "trl": not args.no_trl,
            "trl_threads": args.trl_threads,
            "trl_bf16": args.trl_bf16,
            "trustbatch_overrides": list(args.overrides),
            "also": {name: list(overrides) for name, overrides in args.also},
            "task": task.name,
            "config": str(task.config.relative_to(REPO)),
        },
        "start": {"pass@1": start["pass@1"], "pass@1_se": start["pass@1_se"]},
        "runs": runs,
        "summary": summary,
    }
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


def plot(report: dict, path: Path) -> None:
    """Completions/s and held-out gain per system: each seed a dot, the mean ± across-seed SE a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(report["settings"].get("also", {}))
    with_trl = report["settings"].get("trl", True)
    systems = ["trustbatch", *(["trl"] if with_trl else []), *variants]
    threads = report["settings"]["trl_threads"]
    changed = [o.split("=", 1) for o in report["settings"].get("trustbatch_overrides", [])]
    mine = "trustbatch" + "".join(f"\n{key.rsplit('.', 1)[-1]}={value}" for key, value in changed)
    trl = (
        f"TRL GRPOTrainer\n({threads} torch thread{'s' if threads != 1 else ''}"
        f"{', bf16' if report['settings'].get('trl_bf16') else ''})"
    )
    labels = [mine, *([trl] if with_trl else []), *(f"trustbatch\n{name}" for name in variants)]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:gray"]
    fig, axes = plt.subplots(1, 2, figsize=(9 + 2 * len(variants), 3.8))
    for ax, key, scale, title in (
        (axes[0], "completions_per_s", 1.0, "completions / s of training"),
        (axes[1], "gain", 100.0, "held-out pass@1 gain (points)"),
    ):
        for i, system in enumerate(systems):
            values = [scale * r[key] for r in report["runs"] if r["system"] == system]
            m = mean(values)
            se = stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
            ax.bar(i, m, yerr=se, capsize=4, color=colors[i % len(colors)], alpha=0.7)
            ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(systems)), labels)
        ax.set_title(title)
    seconds, seeds = report["settings"]["seconds"], report["settings"]["seeds"]
    task = report["settings"].get("task", "quickstart")
    fig.suptitle(f"{task}: {seconds:g} s of training each, seeds {seeds} (dots), mean ± across-seed SE (bars)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
