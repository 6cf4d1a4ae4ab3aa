"""Everything a training run drives, built once: model, optimizer, rollout fleet, rewards, data, tracking.

`setup(cfg)` returns the `Parts` that `app/training/loop.py` orchestrates, restored from a checkpoint when
`cfg.resume` names an interrupted run (`find_resume`). Building order matters and is kept here, out of the
loop: first what can stop the run for a fixable reason, before any model is built or loaded (the config's
start-up checks; the datasets, their tasks, and their prompts tokenized as the engines get them and checked
against the model's context); then the process group; the model (bootstrapped if asked); the rollout engines,
started from the weights the run continues from; FSDP2 sharding; the optimizer; the checkpoint restore; the
reward runner; MLflow last.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from app.config import Config, ConfigError, check_trainable, to_yaml
from app.data import DataConfig, DatasetError, PromptRow, limit_prompt_lengths, load_split
from app.evaluation import EvalResult, sample_and_score, stop_token_ids
from app.rollout.base import Completion, SamplingParams
from app.rollout.embedded import EmbeddedEngine
from app.rollout.fleet import Fleet
from app.rollout.process import LocalServerProcess
from app.rollout.sglang import SGLangClient
from app.rollout.sglang_server import launch_servers
from app.scoring import rewards_with_sandbox
from app.tracking import Tracker, default_tracking_uri
from app.training.bootstrap import ensure_model
from rewards import check_tasks
from rewards.runner import RewardRunner
from trainer.checkpoint import checkpoint_problem, list_checkpoints, load_checkpoint
from trainer.distributed import DistInfo, Reducer, barrier, init_distributed, shard_model
from trainer.model import build_tiny_tokenizer, encode_prompt, load_model
from trainer.optim import build_optimizer

log = logging.getLogger("trustbatch")


class PromptSampler:
    """Seeded epochs over the training prompts; `cursor` is the data position (for resumption)."""

    def __init__(self, size: int, seed: int, cursor: int = 0):
        self.size, self.seed, self.cursor = size, seed, cursor

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            epoch, offset = divmod(self.cursor, self.size)
            order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            n = min(k - len(out), self.size - offset)
            out += order[offset : offset + n]
            self.cursor += n
        return out


@dataclass
class Prompts:
    rows: list[PromptRow]
    ids: list[list[int]]


@dataclass
class Resume:
    """Where a run starts: step 0 of a new run, or the last complete checkpoint of an interrupted one."""

    step: int = 0
    """Optimizer steps already taken (= the policy version of the weights the run starts from)."""
    run_dir: Path | None = None
    """The interrupted run's directory: the resumed run writes there."""
    checkpoint: Path | None = None
    state: dict = field(default_factory=dict)
    """The checkpoint's state.json (empty for a new run)."""
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    """Checkpoints marked complete that cannot be resumed from, with why; `setup` moves them aside."""


@dataclass
class Parts:
    """Everything the loop drives, built once by `setup`."""

    cfg: Config
    dist: DistInfo
    reducer: Reducer
    model_dir: Path
    model: torch.nn.Module
    tokenizer: object
    fleet: Fleet
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    runner: RewardRunner
    tracker: Tracker
    train: Prompts
    eval: Prompts
    sampling: SamplingParams
    resume: Resume

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        self.runner.close()


def find_resume(cfg: Config) -> Resume:
    """The checkpoint `cfg.resume` points at (a run directory or an MLflow run id), or a fresh start."""
    if not cfg.resume:
        return Resume()
    run_dir = Path(cfg.resume)
    if not run_dir.is_dir():
        run_dir = _run_dir_of_mlflow_run(cfg, cfg.resume)
    root = run_dir / "checkpoints"
    found = list_checkpoints(root)
    if not found:
        raise ConfigError(
            f"resume={cfg.resume}: no complete checkpoint under {root} (the run was "
            "interrupted before its first checkpoint, or checkpoint.every=0); start it again without resume"
        )
    # Every kept checkpoint is checked, not only the newest: the loop reads each one's state.json later.
    steps = {path: step for step, path in found}
    problems = {path: checkpoint_problem(path) for _, path in found}
    damaged = [(path, problem) for path, problem in problems.items() if problem is not None]
    usable = [path for _, path in found if problems[path] is None]
    if not usable:
        listed = "; ".join(f"{path}: {problem}" for path, problem in damaged)
        raise ConfigError(
            f"resume={cfg.resume}: no checkpoint under {root} can be resumed from ({listed}); restore one from a "
            "backup, or start the run again without resume"
        )
    checkpoint = usable[-1]
    for path, problem in damaged:
        log.warning(
            "resume: checkpoint %s is marked complete but damaged (%s); resuming from %s instead%s",
            path,
            problem,
            checkpoint.name,
            " (it is newer: its steps are redone)" if steps[path] > steps[checkpoint] else "",
        )
    state = json.loads((checkpoint / "state.json").read_text())
    return Resume(
        step=int(state["step"]), run_dir=run_dir, checkpoint=checkpoint, state=state, damaged=damaged
    )


def set_aside(damaged: list[tuple[Path, str]]) -> None:
    """Rename damaged checkpoints to `step-N.damaged` (kept for inspection): no longer listed, pruned or
    resumed from, and a later checkpoint of the same step gets the name back."""
    for path, _ in damaged:
        target = path.with_name(f"{path.name}.damaged")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.damaged{n}")
        path.rename(target)
        log.warning("resume: moved the damaged checkpoint %s to %s", path, target.name)


def _run_dir_of_mlflow_run(cfg: Config, run_id: str) -> Path:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = cfg.tracking.uri or default_tracking_uri(cfg.run.path.parent)
    try:
        run = MlflowClient(tracking_uri=uri).get_run(run_id)
    except MlflowException as exc:
        raise ConfigError(
            f"resume={run_id}: not a directory, and not a run in the MLflow store {uri} ({exc.message}); "
            "give the run directory (e.g. resume=runs/quickstart) or the run id shown at the end of training"
        ) from None
    run_dir = run.data.tags.get("trustbatch.run_dir")
    if not run_dir or not Path(run_dir).is_dir():
        raise ConfigError(f"resume={run_id}: MLflow run found, but its run directory {run_dir!r} is gone")
    return Path(run_dir)


def make_fleet(cfg: Config, model_dir: Path, dist: DistInfo, resume: Resume, tokenizer) -> Fleet:
    """The configured rollout engine under supervision, publishing each new version (`Fleet.publish`);
    `local` first starts this rank's CPU rollout server, `sglang` with `launch.num_servers` this rank's SGLang
    servers (otherwise it connects to `urls`). Versions on disk go to `<run dir>/weights/v<N>/`."""
    r = cfg.rollout
    version = resume.step
    publication = dict(
        weights_dir=cfg.run.path / "weights", tokenizer=tokenizer, is_main=dist.is_main, wait_for_push=r.max_lag == 0
    )
    if r.engine == "embedded":
        engine = EmbeddedEngine.from_pretrained(
            model_dir, max_batch_size=r.max_batch_size, policy_version=version
        )
        return Fleet(engine, [], r.supervision, health_timeout_s=r.sglang.health_timeout_s, **publication)
    servers, client_cfg = [], r.sglang
    if r.engine == "local":
        server = LocalServerProcess(
            model_dir,
            max_batch_size=r.max_batch_size,
            log_path=cfg.run.path / f"rollout-server-rank{dist.rank}.log",
            weight_version=str(version),
        )
        servers.append(server)
        client_cfg = replace(
            client_cfg, urls=[server.start()], health_timeout_s=min(client_cfg.health_timeout_s, 180.0)
        )
        log.info(
            "rank %d: started the CPU rollout server at %s (log %s)", dist.rank, server.url, server.log_path
        )
    elif r.sglang.launch.num_servers:
        # Every trainer rank starts its own servers (ports, GPUs and seeds offset by rank); blocks until healthy.
        servers = launch_servers(
            r.sglang.launch,
            model_dir,
            cfg.run.path,
            weight_version=version,
            first_index=dist.rank * r.sglang.launch.num_servers,
        )
        client_cfg = replace(client_cfg, urls=[server.url for server in servers])
        log.info("rank %d: launched SGLang at %s", dist.rank, ", ".join(client_cfg.urls))
    client = SGLangClient(client_cfg, policy_version=version)
    fleet = Fleet(
        client,
        servers,
        r.supervision,
        health_timeout_s=client_cfg.health_timeout_s,
        weight_sync=client_cfg.weight_sync,
        **publication,
    )
    if resume.checkpoint is not None and r.engine == "sglang":
        fleet.latest = (resume.checkpoint / "model", version)  # handed to URL-given servers by Fleet.connect
    return fleet


def _check_tasks(cfg: Config, rows: list[PromptRow]) -> None:
    try:
        check_tasks(cfg.rewards, {row.task for row in rows})
    except ValueError as exc:
        raise ConfigError(f"data.train={cfg.data.train!r} / data.eval={cfg.data.eval!r}: {exc}") from None


def encode_rows(tokenizer, rows: list[PromptRow]) -> list[list[int]]:
    """Token ids of each row as the rollout engines get them (`encode_prompt`: plain prompts without special
    tokens, chats through the chat template); plain prompts are tokenized in batches (fast tokenizers run them
    in Rust), which gives the same ids as one at a time."""
    out: list[list[int] | None] = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if row.prompt is not None]
    for start in range(0, len(plain), 4096):
        chunk = plain[start : start + 4096]
        encoded = tokenizer([rows[i].prompt for i in chunk], add_special_tokens=False)["input_ids"]
        for i, ids in zip(chunk, encoded, strict=True):
            out[i] = list(ids)
    for i, row in enumerate(rows):
        if row.prompt is None:
            try:
                out[i] = encode_prompt(tokenizer, None, row.messages)
            except ValueError as exc:  # e.g. a model without a chat template for `messages` rows
                raise DatasetError(f"{row.origin or 'a row'}: cannot tokenize its messages: {exc}") from None
    return out  # type: ignore[return-value]


@dataclass
class PromptSets:
    """The train and eval prompts of a run, tokenized and checked against the model's context."""

    train: Prompts
    eval: Prompts
    dropped: dict[str, int] = field(default_factory=dict)
    """Prompts left out for their length (data.on_long_prompt=drop), per split."""


def prepare_prompts(
    cfg: Config,
    tokenizer,
    context: int | None,
    train_rows: list[PromptRow],
    eval_rows: list[PromptRow],
    where: str,
) -> PromptSets:
    """Tokenize the training rows and the eval rows an evaluation uses (the first eval.num_prompts that fit);
    a prompt that leaves fewer than rollout.max_new_tokens positions in `context` is an error or dropped
    (data.on_long_prompt). `where` names the model the context comes from."""
    data: DataConfig = cfg.data
    n_eval = cfg.eval.num_prompts
    if context is None:  # the model states no context length: nothing to check against
        return PromptSets(
            Prompts(train_rows, encode_rows(tokenizer, train_rows)),
            Prompts(eval_rows[:n_eval], encode_rows(tokenizer, eval_rows[:n_eval])),
            {"train": 0, "eval": 0},
        )
    limit = context - cfg.rollout.max_new_tokens
    why = (
        f"the model's context is {context} tokens (max_position_embeddings of {where}) and "
        f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} are kept for the completion"
    )
    common = dict(max_prompt_tokens=limit, on_long_prompt=data.on_long_prompt, why=why)
    rows, ids, dropped_train = limit_prompt_lengths(
        train_rows, encode_rows(tokenizer, train_rows), source_key="data.train", source=data.train, **common
    )
    train = Prompts(rows, ids)
    # Eval: tokenize only as many rows as an evaluation uses (more when some are dropped).
    kept_rows: list[PromptRow] = []
    kept_ids: list[list[int]] = []
    dropped_eval, start = 0, 0
    while len(kept_rows) < n_eval and start < len(eval_rows):
        chunk = eval_rows[start : start + n_eval - len(kept_rows)]
        start += len(chunk)
        rows, ids, dropped = limit_prompt_lengths(
            chunk, encode_rows(tokenizer, chunk), source_key="data.eval", source=data.eval, **common
        )
        kept_rows += rows
        kept_ids += ids
        dropped_eval += dropped
    for key, kept in (("train", train.rows), ("eval", kept_rows)):
        if not kept:
            raise DatasetError(
                f"data.{key}={getattr(data, key)!r}: every prompt is longer than {limit} tokens ({why}), so "
                "data.on_long_prompt=drop leaves none; use shorter prompts or lower rollout.max_new_tokens"
            )
    for split, count, total in (("train", dropped_train, len(train_rows)), ("eval", dropped_eval, start)):
        if count:
            log.warning(
                "data.%s: dropped %d of %d prompts longer than %d tokens (data.on_long_prompt=drop; %s)",
                split,
                count,
                total,
                limit,
                why,
            )
    return PromptSets(train, Prompts(kept_rows, kept_ids), {"train": dropped_train, "eval": dropped_eval})


def early_tokenizer(cfg: Config) -> tuple[object, int | None, str] | None:
    """(tokenizer, context length, where) of the model to train, without loading its weights: a local model
    directory's files, or the tiny tokenizer that model.bootstrap will save; None for a hub id (known only
    once the model is loaded)."""
    path = Path(cfg.model.path).expanduser()
    if path.is_dir():
        from transformers import AutoConfig, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            context = getattr(AutoConfig.from_pretrained(str(path)), "max_position_embeddings", None)
        except (OSError, ValueError):
            return None  # load_model reports it, with its own message
        return tokenizer, context, str(path)
    if not path.exists() and cfg.model.bootstrap:
        tiny = cfg.model.tiny.max_position_embeddings
        return build_tiny_tokenizer(), tiny, "model.tiny (model.bootstrap=true)"
    return None


def setup(cfg: Config, resume: Resume) -> Parts:
    """Build the run; the caller owns the returned Parts (close them) and awaits `fleet.engine` health."""
    # Everything that can stop the run for a fixable reason comes first, before any model is built or loaded.
    check_trainable(cfg)
    train_rows = load_split(cfg.data, "train")
    eval_rows = load_split(cfg.data, "eval")
    _check_tasks(cfg, train_rows + eval_rows[: cfg.eval.num_prompts])
    early = early_tokenizer(cfg)
    sets = None
    if early is not None:
        tokenizer, context, where = early
        sets = prepare_prompts(cfg, tokenizer, context, train_rows, eval_rows, where)

    dist = init_distributed()
    reducer = dist.reducer()
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    if dist.is_main:
        cfg.run.path.mkdir(parents=True, exist_ok=True)
        (cfg.run.path / "config.yaml").write_text(to_yaml(cfg))
        set_aside(resume.damaged)

    model_dir = ensure_model(cfg.model, cfg.data, is_main=dist.is_main, barrier=barrier)
    model, tokenizer = load_model(str(model_dir), dtype=cfg.model.dtype)
    if sets is None:  # a hub model: its tokenizer and context are known now
        context = getattr(model.config, "max_position_embeddings", None)
        sets = prepare_prompts(cfg, tokenizer, context, train_rows, eval_rows, cfg.model.path)
    _check_tasks(cfg, sets.train.rows + sets.eval.rows)

    # Generation ends at EOS, and at the chat template's end-of-turn token when the tokenizer has one.
    engine_dir = resume.checkpoint / "model" if resume.checkpoint is not None else model_dir
    fleet = make_fleet(cfg, engine_dir, dist, resume, tokenizer)
    runner: RewardRunner | None = None
    try:
        if dist.world_size > 1:
            shard_model(model)
        model.train()
        optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.run.steps)
        if resume.checkpoint is not None:
            try:
                load_checkpoint(
                    resume.checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, rank=dist.rank
                )
            except Exception as exc:  # noqa: BLE001 - damage that checkpoint_problem cannot see (inside a file)
                raise ConfigError(
                    f"resume={cfg.resume}: checkpoint {resume.checkpoint} cannot be loaded ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}); move it aside (mv {resume.checkpoint} "
                    f"{resume.checkpoint}.damaged) to resume from the previous complete checkpoint"
                ) from None
            log.info("resuming %s from %s (step %d)", cfg.run.path, resume.checkpoint, resume.step)
        try:
            runner = RewardRunner(rewards_with_sandbox(cfg.rewards, cfg.sandbox))
        except (TypeError, ValueError) as exc:  # a package.module:factory verifier's params are checked here
            raise ConfigError(str(exc)) from None
        tracker = Tracker(
            cfg.tracking,
            cfg.run.path,
            run_name=cfg.run.name,
            enabled=dist.is_main,
            resume_run_id=resume.state.get("mlflow_run_id"),
        )
        tracker.log_config(cfg)
        counts = {f"data/dropped_long_prompts/{split}": float(n) for split, n in sets.dropped.items()}
        counts["data/train_prompts"] = float(len(sets.train.rows))
        counts["data/eval_prompts"] = float(len(sets.eval.rows))
        tracker.log_metrics(counts, step=resume.step)
    except BaseException:
        if runner is not None:
            runner.close()
        for server in fleet.servers:
            server.stop()
        raise
    r = cfg.rollout
    return Parts(
        cfg=cfg,
        dist=dist,
        reducer=reducer,
        model_dir=model_dir,
        model=model,
        tokenizer=tokenizer,
        fleet=fleet,
        optimizer=optimizer,
        scheduler=scheduler,
        runner=runner,
        tracker=tracker,
        train=sets.train,
        eval=sets.eval,
        sampling=SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            n=r.group_size,
            stop_token_ids=stop_token_ids(tokenizer),
        ),
        resume=resume,
    )


class Evaluator:
    """Held-out sampled pass@1 at the training temperature (+ greedy), the same prompts and seed each time.

    `generate` is a blocking call (the loop hands it one that submits to the fleet on the event loop), because
    evaluation runs in a worker thread while rollouts of the next steps go on. Sampling and scoring are
    app/evaluation.py `sample_and_score` (each rank its share of the prompts), the accuracies its records
    summed over ranks.
    """

    def __init__(self, cfg: Config, p: Parts):
        self.cfg, self.p = cfg, p
        self.results: dict[int, dict[str, EvalResult]] = {}
        self.history: list[dict[str, float]] = []
        for step, runs in p.resume.state.get("evals", {}).items():
            self.results[int(step)] = {name: EvalResult(**result) for name, result in runs.items()}
        self.history = list(p.resume.state.get("eval_history", []))

    def __call__(self, step: int, generate) -> dict[str, float]:
        cfg, p, t0 = self.cfg, self.p, time.perf_counter()
        base = replace(p.sampling, seed=cfg.run.seed + 17)
        runs = {"sampled": replace(base, n=cfg.eval.samples_per_prompt)}
        if cfg.eval.greedy:
            runs["greedy"] = replace(base, n=1, temperature=0.0, top_p=1.0)
        rows, ids = p.eval.rows, p.eval.ids
        self.results[step] = {}
        for name, params in runs.items():
            scored = sample_and_score(generate, rows, ids, params, p.runner, p.decode, reducer=p.reducer)
            self.results[step][name] = EvalResult.from_samples(scored.samples, len(rows), params.n, p.reducer)
        sampled = self.results[step]["sampled"]
        out = {
            "step": step,
            "eval/accuracy": sampled.accuracy,
            "eval/accuracy_se": sampled.stderr,
            "eval/samples": sampled.samples,
        }
        if sampled.answer_rate is not None:
            out["eval/answer_rate"] = sampled.answer_rate
        if "greedy" in self.results[step]:
            greedy = self.results[step]["greedy"]
            out["eval/greedy_accuracy"] = greedy.accuracy
            if greedy.answer_rate is not None:
                out["eval/greedy_answer_rate"] = greedy.answer_rate
        out["timing/eval"] = time.perf_counter() - t0
        p.tracker.log_metrics(out, step=step)
        self.history.append(out)
        return out

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run reports the same gains and plot."""
        return {
            "evals": {
                str(step): {
                    name: {"per_prompt": r.per_prompt, "samples": r.samples, "answer_rate": r.answer_rate}
                    for name, r in runs.items()
                }
                for step, runs in self.results.items()
            },
            "eval_history": self.history,
        }


def completions_version(completions: list[Completion]) -> int:
    """The policy version of a group: its oldest completion's (a staleness bound must not be too lenient)."""
    return min(c.policy_version for c in completions)
