"""The TRL side of bench/vs_trl.py: Hugging Face TRL's GRPOTrainer on one of its tasks, for a time limit.

Runs in .venv-trl (bench/trl_env/build.sh), never in the project's .venv, and imports nothing of `app`: the
parent writes the training prompts as JSONL and passes every setting on the command line. One row per line:
`prompt` (a plain string, or a chat as a list of {role, content}: TRL applies the chat template), `reference`
(JSON text of the gold answer or the list of tests), `task`, `row_id`, `metadata` (JSON text), and `prompt_ids`, the token ids
trustbatch's engines get for that prompt (checked against TRL's own tokenization before training). The reward
is one of trustbatch's own verifiers (`--verifier math` or `code`; rewards/ and sandbox/, put on sys.path from
the repo root; they need only math-verify, omegaconf and the standard library), with the params the parent
passes, scored as trustbatch's reward runner scores: the verifier's reward, or `--error-reward` when it could
not judge the sample. `--reward-workers` samples are scored at once (a thread pool: a code sample waits on its
sandbox process), as trustbatch runs `rewards.num_workers` reward processes.

It trains from a fresh copy of the warm-started model until `--seconds` of training wall time have passed
(checked after each optimizer step, as `run.time_limit_s` is in trustbatch), saves the final model as a
Hugging Face directory in `<out>/model`, and writes `<out>/result.json`: steps, completions generated, training
wall time, time inside generation, the size of each generate call, the reward per step.

    .venv-trl/bin/python bench/trl_worker.py --model DIR --prompts train.jsonl --out DIR --seconds 300 --seed 0
"""

from __future__ import annotations

import os

# No network at run time: everything is on disk (the model directory, the prompts). Set before transformers,
# datasets and huggingface_hub are imported, since they read these once.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_name] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # trustbatch's `rewards` package (standard library + math-verify + omegaconf)

import datasets  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rewards import VerifierInput, build_verifier  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, required=True, help="HF model directory (a fresh copy: it is read only)"
    )
    parser.add_argument(
        "--prompts", type=Path, required=True, help="JSONL of training rows (see the module docstring)"
    )
    parser.add_argument("--out", type=Path, required=True, help="writes model/ and result.json here")
    parser.add_argument(
        "--seconds", type=float, required=True, help="training wall time (checked after each step)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bf16", action="store_true",
        help="bf16=True: accelerate autocasts the model's forward (generation and training) to bfloat16",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--scale-by-std", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--verifier", default="math", help="trustbatch verifier: math or code")
    parser.add_argument(
        "--verifier-params",
        type=json.loads,
        default={"numeric_answer": True},
        help="params of the trustbatch verifier, as JSON",
    )
    parser.add_argument("--reward-workers", type=int, default=1, help="samples scored at once (threads)")
    parser.add_argument(
        "--error-reward", type=float, default=0.0, help="reward of a sample the verifier can't judge"
    )
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------- reward


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """TRL passes a plain completion as text and a chat completion as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """The prompt as trustbatch's scorer gives it to a verifier: a chat's message contents, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(message["content"] for message in prompt)


def trustbatch_reward(
    name: str, params: dict[str, Any], error_reward: float, workers: int
) -> Callable[..., list[float]]:
    """A TRL reward function around one of trustbatch's verifiers, scoring as trustbatch's runner does: the
    verifier's reward, or `error_reward` when it could not judge the sample (rewards.error_reward)."""
    verify = build_verifier(name, **params)
    pool = ThreadPoolExecutor(max_workers=max(1, workers))

    def score(sample: VerifierInput) -> float:
        result = verify(sample)
        return error_reward if result.error is not None else float(result.reward)

    def trustbatch_verifier(
        prompts: list, completions: list, reference: list[str], task: list[str], row_id: list[str],
        metadata: list[str], **_: Any,
    ) -> list[float]:  # fmt: skip
        samples = [
            VerifierInput(
                prompt_text(p), completion_text(c), json.loads(ref), {**json.loads(meta), "task": t, "id": i}
            )
            for p, c, ref, t, i, meta in zip(prompts, completions, reference, task, row_id, metadata, strict=True)
        ]
        return list(pool.map(score, samples))

    trustbatch_verifier.__name__ = f"trustbatch_{name}"  # TRL logs each reward function under its name
    return trustbatch_verifier


# ---------------------------------------------------------------------------------------------- trainer


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that also records where a step's time goes: each generate call (its size and time) and the
    reward computation (TRL's own profiling timers only report to wandb / trackio). Overrides two private
    methods of trl 1.16.0 (pinned), calling them unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generate_s = 0.0
        self.reward_s = 0.0
        self.generate_calls: list[int] = []  # sequences per call

    def _generate_single_turn(self, prompt_ids, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self.generate_s += time.perf_counter() - start
        self.generate_calls.append(len(completion_ids))
        return completion_ids, logprobs

    def _calculate_rewards(self, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        rewards = super()._calculate_rewards(*args, **kwargs)
        self.reward_s += time.perf_counter() - start
        return rewards


class TimeLimit(TrainerCallback):
    """Stop after the first optimizer step that ends `seconds` after training began (model loading excluded)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = 0.0
        self.elapsed = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.elapsed = time.perf_counter() - self.start
        if self.elapsed >= self.seconds:
            control.should_training_stop = True


def load_model(path: Path):
    """The model in float32 (as trustbatch trains it) and its tokenizer; generation stops where trustbatch's does."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # trustbatch stops at EOS and at the chat end-of-turn token (app/data/prepare.py stop_token_ids). GRPOTrainer
    # stops at the model's generation_config.eos_token_id plus the tokenizer's EOS, so declare both there.
    vocab = tokenizer.get_vocab()
    model.generation_config.eos_token_id = sorted(
        {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>",) if t in vocab}
    )
    return model, tokenizer


def load_prompts(path: Path, tokenizer) -> datasets.Dataset:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # GRPOTrainer tokenizes a plain prompt with the tokenizer's defaults (special tokens added) and a chat with
    # apply_chat_template(add_generation_prompt=True); trustbatch's engines get the ids the parent wrote. The
    # comparison holds only where the two agree, so check a sample of rows before training.
    for row in rows[:256]:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        if list(ids) != row["prompt_ids"]:
            raise SystemExit(
                f"row {row['row_id']}: GRPOTrainer would see other prompt ids than trustbatch's engines "
                f"({list(ids)[:12]}... against {row['prompt_ids'][:12]}...), so the comparison would not be like for like"
            )
    return datasets.Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "reference": r["reference"],
                "task": r["task"],
                "row_id": str(r["row_id"]),
                "metadata": r["metadata"],
            }
            for r in rows
        ]
    )


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    completions_per_step = args.prompts_per_step * args.group_size
    return GRPOConfig(
        output_dir=str(args.out / "trainer"),
        seed=args.seed,
        use_cpu=True,
        # One generation batch of prompts_per_step x group_size completions per optimizer step, used once:
        # generation_batch_size = per_device_train_batch_size x steps_per_generation (= grad accumulation = 1).
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        # The objective: GRPO advantages (group mean, / group std), no KL term, no reference model.
        beta=0.0,
        scale_rewards="group" if args.scale_by_std else "none",
        loss_type="dapo",  # token sum / tokens in the batch: trustbatch's normalisation (trainer/objective.py)
        # The optimizer of configs/quickstart.yaml: AdamW, constant learning rate, no warm-up, no weight decay.
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        max_grad_norm=args.max_grad_norm,
        # TRL defaults that trustbatch does not share: bf16 autocast (unless --bf16, to match trustbatch's
        # trainer.compute_dtype=bfloat16) and gradient (activation) checkpointing.
        bf16=args.bf16,
        fp16=False,
        activation_checkpointing=False,
        max_steps=10**7,  # the time limit decides
        logging_steps=1,  # one log row per step: its reward
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model)
    dataset = load_prompts(args.prompts, tokenizer)
    limit = TimeLimit(args.seconds)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=trustbatch_reward(args.verifier, args.verifier_params, args.error_reward, args.reward_workers),
        args=grpo_config(args),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[limit],
    )
    threads = torch.get_num_threads()
    print(f"trl {trl.__version__}: training for {args.seconds:g} s, {threads} torch thread(s)", flush=True)
    trainer.train()
    threads_at_end = torch.get_num_threads()
    trainer.save_model(str(args.out / "model"))

    history = [row for row in trainer.state.log_history if "reward" in row]
    completions = sum(trainer.generate_calls)
    result = {
        "steps": trainer.state.global_step,
        "completions": completions,
        "train_s": limit.elapsed,
        "completions_per_s": completions / max(limit.elapsed, 1e-9),
        "generate_s": trainer.generate_s,
        "reward_s": trainer.reward_s,
        "generate_calls": len(trainer.generate_calls),
        "sequences_per_generate_call": sorted(set(trainer.generate_calls)),
        "completions_per_step": completions / max(trainer.state.global_step, 1),
        "torch_threads": threads_at_end,
        "bf16_autocast": args.bf16,
        "weights_dtype": str(next(trainer.model.parameters()).dtype),
        "activation_checkpointing": bool(trainer.model.is_activation_checkpointing),
        "reward_per_step": [row["reward"] for row in history],
        "mean_completion_length": [row.get("completions/mean_length") for row in history],
        "frac_reward_zero_std": [row.get("frac_reward_zero_std") for row in history],
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "model_dir": str(args.out / "model"),
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"done: {result['steps']} steps, {completions} completions in {limit.elapsed:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
