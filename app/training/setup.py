"""Everything a training run drives, built once: model, optimizer, rollout fleet, rewards, prompts, tracking.

`setup(cfg, resume)` returns the `Parts` that app/training/loop.py orchestrates, restored from a checkpoint when
``resume`` names one (app/training/resume.py). Building order matters and is kept here, out of the loop: first
what can stop the run for a fixable reason, before any model is built or loaded (the config's start-up checks;
the datasets, their tasks, and their prompts tokenized as the engines get them and checked against the model's
context, app/data/prepare.py); then the process group; the model (bootstrapped if asked); the rollout engine
(app/engines.py `open_engine`), started from the weights the run continues from; FSDP2 sharding; the optimizer;
the checkpoint restore; the reward runner; MLflow last. What was started is closed by `Parts.close`, also when
setup itself fails half way.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.config import Config, ConfigError, check_trainable, flatten, to_yaml
from app.data import PromptRow, load_split
from app.data.decontaminate import Overlaps, decontaminate
from app.data.loaders import SOURCE_KEY
from app.data.prepare import ModelText, Prompts, prepare_prompts
from app.data.sources import source_sizes
from app.engines import EngineOptions, open_engine
from app.evaluation.benchmarks import Benchmark, load_benchmark, resolve
from app.evaluation.held_out import BenchmarkSet, HeldOut
from app.rollout.base import Completion, SamplingParams
from app.rollout.fleet import Fleet
from app.rollout.probe import PublishCheck, probe_ids
from app.rollout.sglang_server import LoraServing
from app.scoring import rewards_with_sandbox
from app.tooling import ToolKit, ToolRollouts, load_toolkit, open_tool_rollouts
from app.tracking import Tracker
from app.training.bootstrap import ensure_model
from app.training.resume import Resume, set_aside
from app.training.sampler import MixtureSampler, PromptSampler
from rewards import check_tasks
from rewards.runner import RewardRunner
from trainer.checkpoint import load_checkpoint
from trainer.distributed import DistInfo, Reducer, barrier, gather_objects, init_distributed, shard_model
from trainer.lora import apply_lora
from trainer.model import build_tiny_tokenizer, load_model
from trainer.optim import build_optimizer
from trainer.precision import bf16_hardware_problem, fsdp_param_dtype

log = logging.getLogger("trustbatch")


@dataclass
class Policy:
    """What training updates and saves: the model, its tokenizer, the optimizer and the learning-rate schedule."""

    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    model_dir: Path
    """The directory the run started from (the bootstrapped or pretrained model)."""
    reference: torch.nn.Module | None = None
    """The frozen starting policy (`objective.ref_kl_coef` > 0): what the reference-KL penalty pulls toward."""


@dataclass
class Parts:
    """Everything the loop drives, built once by `setup`."""

    cfg: Config
    dist: DistInfo
    reducer: Reducer
    policy: Policy
    text: ModelText
    fleet: Fleet
    runner: RewardRunner
    tracker: Tracker
    train: Prompts
    held_out: HeldOut
    sampling: SamplingParams
    """How rollouts sample (rollout.*; n = group_size)."""
    resume: Resume
    closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """The engine's servers, the reward runner and the tool pool, closed by `close`."""
    tools: ToolRollouts | None = None
    """Multi-turn tool rollouts (the `tools` section; app/tooling.py), or None."""

    async def rollouts(self, prompts: list[list[int]], params: SamplingParams, tasks: list[str]) -> list[Completion]:
        """Sample ``params.n`` completions of each prompt through the fleet: tool episodes for the rows of a task
        with tools (``tasks``: each prompt's row's task), one request for the others."""
        if self.tools is None:
            return await self.fleet.generate(prompts, params)
        return await self.tools.generate(prompts, params, tasks)

    def sampler(self, cursor: int = 0) -> PromptSampler | MixtureSampler:
        """The order prompts are drawn in: seeded epochs over data.train, or, when data.train lists several
        sources, a mixture drawing each source in proportion to its weight; resumable from ``cursor``."""
        r, specs = self.cfg.rollout, self.cfg.data.sources("train")
        if len(specs) == 1:
            return PromptSampler(len(self.train.rows), self.cfg.run.seed, cursor=cursor, skip_decided=r.skip_decided)
        groups = source_sizes(self.train.rows, specs)
        return MixtureSampler(groups, [spec.weight for spec in specs], self.cfg.run.seed, cursor=cursor,
                              skip_decided=r.skip_decided)  # fmt: skip

    def close(self) -> None:
        self.closing.close()

    def kill(self) -> None:
        """A second signal: kill the servers this run started (their whole process groups) and the reward workers,
        nothing waited for; the process exits right after (app/stopping.py)."""
        for server in self.fleet.servers:
            server.kill()
        self.runner.kill()


@dataclass
class PromptSets:
    """The train and eval prompts of a run, tokenized and checked against the model's context."""

    train: Prompts
    eval: Prompts

    @property
    def dropped(self) -> dict[str, int]:
        """Prompts left out for their length (data.on_long_prompt=drop), per split."""
        return {"train": self.train.dropped, "eval": self.eval.dropped}


def run_prompts(
    cfg: Config, text: ModelText, train_rows: list[PromptRow], eval_rows: list[PromptRow], kit: ToolKit | None = None
) -> PromptSets:
    """The training rows, and the eval rows an evaluation uses (the first eval.num_prompts that fit), tokenized
    and checked against the model's context (`prepare_prompts`). With tools, each prompt leaves room for a whole
    tool-using answer (rollout.max_total_tokens) and hermes prompts show the tools' schemas."""
    tools = kit is not None
    common = dict(
        on_long_prompt=cfg.data.on_long_prompt,
        new_tokens_key="rollout.max_total_tokens" if tools else "rollout.max_new_tokens",
        chat_tools=kit.chat_tools(cfg.rollout.tool_format) if tools else None,
    )
    new_tokens = max(cfg.rollout.max_new_tokens, cfg.rollout.total_tokens if tools else 0)
    train = prepare_prompts(
        train_rows, text, max_new_tokens=new_tokens, source_key="data.train", source=cfg.data.describe("train"), **common,
    )  # fmt: skip
    eval_new_tokens = max(new_tokens, cfg.eval.max_new_tokens or 0)
    held_out = prepare_prompts(
        eval_rows, text, max_new_tokens=eval_new_tokens, source_key="data.eval", source=cfg.data.describe("eval"),
        keep=cfg.eval.num_prompts, **common,
    )  # fmt: skip
    return PromptSets(train, held_out)


def check_run_tasks(cfg: Config, rows: list[PromptRow]) -> None:
    """Every source's tasks have a verifier: else stop, naming the source, its tasks and the fix."""
    by_source: dict[str, set[str]] = {}
    for row in rows:
        by_source.setdefault(str(row.metadata.get("data_source", "")), set()).add(row.task)
    for name, tasks in by_source.items():
        try:
            check_tasks(cfg.rewards, tasks)
        except ValueError as exc:
            raise ConfigError(
                f"data source {name!r} (data.train={cfg.data.describe('train')!r} / data.eval="
                f"{cfg.data.describe('eval')!r}): {exc} Or set the source's `task` to one the verifiers score."
            ) from None


def run_benchmarks(cfg: Config) -> list[tuple[Benchmark, list[PromptRow]]]:
    """The benchmarks of ``eval.benchmarks`` and their problems (local mirrors from ``eval.bench_dir``)."""
    return [(bench, load_benchmark(bench, cfg.data)) for bench in resolve(list(cfg.eval.benchmarks), cfg.eval.bench_dir or None)]


def evaluation_sets(eval_rows: list[PromptRow], benchmarks: list[tuple[Benchmark, list[PromptRow]]]) -> dict[str, list[PromptRow]]:
    """What the training rows are checked against for contamination: each data.eval source, each benchmark."""
    sets: dict[str, list[PromptRow]] = {}
    for row in eval_rows:
        sets.setdefault(f"data.eval:{row.metadata.get(SOURCE_KEY, '')}", []).append(row)
    for bench, rows in benchmarks:
        sets[f"bench:{bench.name}"] = rows
    return sets


def report_overlap(overlap: Overlaps, mode: str) -> None:
    """The decontamination report, one log line per (training source, evaluation set) that overlap."""
    if not overlap.counts:
        log.info("decontamination: no training row shares a 13-gram with an evaluation set")
        return
    verb = "left out" if mode == "drop" else "kept (data.decontaminate=report; drop leaves them out)"
    for line in overlap.lines():
        log.warning("decontamination: %s", line)
    log.warning("decontamination: %d training row(s) overlap an evaluation set: %s", len(overlap.rows), verb)


def overlap_metrics(overlap: Overlaps, *, dropped: bool) -> dict[str, float]:
    """data/overlap/<train source>/<evaluation set> and data/contaminated_rows (data/decontaminated_rows when
    dropped), for MLflow."""
    clean = lambda name: re.sub(r"[^\w\-. /:]", "_", name)  # noqa: E731 - MLflow's metric-name alphabet
    out = {f"data/overlap/{clean(train)}/{clean(other)}": float(n) for (train, other), n in overlap.counts.items()}
    out["data/contaminated_rows"] = float(len(overlap.rows))
    out["data/decontaminated_rows"] = float(len(overlap.rows) if dropped else 0)
    return out


def benchmark_sets(cfg: Config, text: ModelText, benchmarks: list[tuple[Benchmark, list[PromptRow]]]) -> list[BenchmarkSet]:
    """Each benchmark's problems tokenized for the model, with its customary sampling; the completion budget is
    eval.max_new_tokens (else the benchmark's own), less where the longest problem leaves less of the context;
    problems too long for the context are left out and counted."""
    out = []
    for bench, rows in benchmarks:
        prompts = prepare_prompts(
            rows, text, max_new_tokens=cfg.eval.max_new_tokens or bench.max_new_tokens, on_long_prompt="drop",
            source_key="eval.benchmarks", source=bench.name, fit=True,
        )  # fmt: skip
        params = SamplingParams(
            max_new_tokens=prompts.max_new_tokens, temperature=bench.temperature, top_p=1.0, n=bench.samples,
            stop_token_ids=text.stop_token_ids, seed=cfg.run.seed + 17,
        )  # fmt: skip
        out.append(BenchmarkSet(bench.name, prompts.rows, prompts.ids, params, bench.k, prompts.dropped))
    return out


def early_text(cfg: Config) -> ModelText | None:
    """The tokenizer and context of the model to train, without loading its weights: a local model directory's
    files, or the tiny tokenizer that model.bootstrap will save; None for a hub id (known once loaded)."""
    path = Path(cfg.model.path).expanduser()
    if path.is_dir():
        try:
            return ModelText.from_dir(path)
        except (OSError, ValueError):
            return None  # load_model reports it, with its own message
    if not path.exists() and cfg.model.bootstrap:
        return ModelText(
            build_tiny_tokenizer(), cfg.model.tiny.max_position_embeddings, "model.tiny (model.bootstrap=true)"
        )
    return None


def check_same_config(cfg: Config) -> None:
    """Under torchrun, stop every rank with one ConfigError when any rank resolved a config unlike rank 0's.

    Each node starts its own ``torchrun`` with its own command line, files and environment (``${oc.env:...}``
    resolves per machine), and a difference is silent until ranks disagree on something collective: a batch
    size, a step count, a weight version. Ranks exchange the flat resolved config once, right after joining the
    group (the first collective of the run), and every rank
    raises the same message naming the differing ranks, their hosts and node ranks, and the keys. (A check that
    fails on one node before the group forms, a data path missing there, stops that node only; the others wait
    in torchrun's rendezvous or in joining the group until its timeout.)
    """
    here = (socket.gethostname(), os.environ.get("GROUP_RANK", "?"), flatten(cfg))
    every = gather_objects(here)
    ref_host, ref_node, ref = every[0]
    problems = []
    for rank, (host, node, flat) in enumerate(every[1:], start=1):
        keys = sorted(k for k in ref.keys() | flat.keys() if ref.get(k, "<unset>") != flat.get(k, "<unset>"))
        if keys:
            shown = ", ".join(f"{k}={flat.get(k, '<unset>')!r} (rank 0: {ref.get(k, '<unset>')!r})" for k in keys[:5])
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            problems.append(f"rank {rank} (host {host}, node {node}): {shown}{more}")
    if problems:
        raise ConfigError(
            f"the ranks resolved different configs; against rank 0 (host {ref_host}, node {ref_node}): "
            + "; ".join(problems)
            + ". Start every node's torchrun with the same config file and overrides (and the same environment "
            "for ${oc.env:...} values), from the same checkout"
        )


def start_process(cfg: Config, resume: Resume) -> DistInfo:
    """This process's part of a run (`train` and `sft`): the process group (torchrun's, or none), torch's threads
    and seed; on rank 0 the run directory, its config.yaml, and the damaged checkpoints moved aside."""
    dist = init_distributed()
    check_same_config(cfg)
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    if dist.is_main:
        cfg.run.path.mkdir(parents=True, exist_ok=True)
        (cfg.run.path / "config.yaml").write_text(to_yaml(cfg))
        set_aside(resume.damaged)
    return dist


def setup(cfg: Config, resume: Resume) -> Parts:
    """Build the run; the caller owns the returned Parts (close them) and awaits `fleet.connect`."""
    # Everything that can stop the run for a fixable reason comes first, before any model is built or loaded.
    check_trainable(cfg)
    train_rows = load_split(cfg.data, "train")
    eval_rows = load_split(cfg.data, "eval")
    benchmarks = run_benchmarks(cfg)
    train_rows, overlap = decontaminate(train_rows, evaluation_sets(eval_rows, benchmarks), cfg.data.decontaminate)
    report_overlap(overlap, cfg.data.decontaminate)
    check_run_tasks(cfg, train_rows + eval_rows[: cfg.eval.num_prompts] + [r for _, rows in benchmarks for r in rows])
    try:
        kit = load_toolkit(cfg.tools)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    text = early_text(cfg)
    sets = run_prompts(cfg, text, train_rows, eval_rows, kit) if text is not None else None

    dist = start_process(cfg, resume)
    reducer = dist.reducer()
    model_dir = ensure_model(cfg.model, cfg.data, is_main=dist.is_main, barrier=barrier, tracking_uri=cfg.tracking_uri)
    model, tokenizer = load_model(str(model_dir), dtype=cfg.model.dtype)
    if sets is None:  # a hub model: its tokenizer and context are known now
        text = ModelText.from_model(model, tokenizer, cfg.model.path)
        sets = run_prompts(cfg, text, train_rows, eval_rows, kit)
    assert text is not None
    check_run_tasks(cfg, sets.train.rows + sets.eval.rows)
    bench_sets = benchmark_sets(cfg, text, benchmarks)

    closing = contextlib.ExitStack()
    try:
        fleet = start_fleet(cfg, closing, model_dir, dist, resume, tokenizer)
        tools = None
        if kit is not None:
            try:
                tools = closing.enter_context(open_tool_rollouts(
                    kit, cfg.rollout, cfg.sandbox, fleet.generate, tokenizer, context=text.context, where=str(model_dir)
                ))  # fmt: skip
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        reference = frozen_reference(model, cfg, dist) if cfg.objective.ref_kl_coef > 0 else None
        optimizer, scheduler = make_trainable(model, cfg, dist, cfg.run.steps)
        if resume.checkpoint is not None:
            restore(cfg, resume, model, optimizer, scheduler, dist.rank)
        try:
            runner = closing.enter_context(RewardRunner(rewards_with_sandbox(cfg.rewards, cfg.sandbox)))
        except (TypeError, ValueError) as exc:  # a package.module:factory verifier's params are checked here
            raise ConfigError(str(exc)) from None
        tracker = Tracker(
            cfg.tracking,
            cfg.run.path,
            run_name=cfg.run.name,
            enabled=dist.is_main,
            resume_run_id=resume.state.get("mlflow_run_id"),
        )
        tracker.log_config(flatten(cfg), to_yaml(cfg))
        counts = {f"data/dropped_long_prompts/{split}": float(n) for split, n in sets.dropped.items()}
        counts["data/train_prompts"] = float(len(sets.train.rows))
        counts["data/eval_prompts"] = float(len(sets.eval.rows))
        counts |= overlap_metrics(overlap, dropped=cfg.data.decontaminate == "drop")
        tracker.log_metrics(counts, step=resume.step)
    except BaseException:
        closing.close()
        raise
    r = cfg.rollout
    held_out = HeldOut(
        cfg.eval.resolved(
            temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=cfg.run.seed + 17
        ),
        sets.eval.rows,
        sets.eval.ids,
        stop_token_ids=text.stop_token_ids,
        runner=runner,
        decode=text.decode,
        reducer=reducer,
        log_metrics=tracker.log_metrics,
        state=resume.state,
        samples_dir=cfg.run.path / "eval",
        rank=dist.rank,
        world_size=dist.world_size,
        benchmarks=bench_sets,
    )
    return Parts(
        cfg=cfg,
        dist=dist,
        reducer=reducer,
        policy=Policy(model, tokenizer, optimizer, scheduler, model_dir, reference),
        text=text,
        fleet=fleet,
        runner=runner,
        tracker=tracker,
        train=sets.train,
        held_out=held_out,
        sampling=SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            n=r.group_size,
            stop_token_ids=text.stop_token_ids,
        ),
        resume=resume,
        closing=closing,
        tools=tools,
    )


def start_fleet(
    cfg: Config, closing: contextlib.ExitStack, model_dir: Path, dist: DistInfo, resume: Resume, tokenizer
) -> Fleet:
    """The configured rollout engine (`open_engine`, its servers stopped by ``closing``) under supervision,
    publishing each new version (`Fleet.publish`); versions on disk go to ``<run dir>/weights/v<N>/``. The
    engines start from the weights the run continues from. A server started here loads while the trainer
    builds its model; `Fleet.connect` waits for it."""
    r = cfg.rollout
    if r.dtype == "bfloat16" and r.engine != "sglang" and (problem := bf16_hardware_problem("cpu")) is not None:
        log.warning("rollout.dtype=bfloat16: %s", problem)
    version = resume.step
    adapters = r.sglang.lora_adapters  # servers keep the base model and load each version's adapter
    engine_dir = resume.checkpoint / "model" if resume.checkpoint is not None and not adapters else model_dir
    serving = lora_serving(cfg)
    opened = closing.enter_context(
        open_engine(
            r.engine,
            engine_dir,
            EngineOptions(
                max_batch_size=r.max_batch_size, sglang=r.sglang, log_dir=cfg.run.path, weight_version=version,
                rank=dist.rank, local_rank=dist.local_rank, wait=False, dtype=r.dtype, lora=serving,
            ),  # fmt: skip
        )
    )
    fleet = Fleet(
        opened.engine,
        opened.servers,
        r.supervision,
        health_timeout_s=(opened.client or r.sglang).health_timeout_s,
        weight_sync=opened.client.weight_sync if opened.client is not None else None,
        weights_dir=cfg.run.path / "weights",
        tokenizer=tokenizer,
        is_main=dist.is_main,
        wait_for_push=r.max_lag == 0,
        check=PublishCheck(r.publish_check, probe_ids(tokenizer), engine_weight_dtype(cfg, opened.kind))
        if r.publish_check.enabled
        else None,
        adapters=r.lag_limit + 1 if adapters else 0,
    )
    if resume.checkpoint is not None and adapters:
        fleet.latest_adapter = (resume.checkpoint / "adapter", version)  # loaded on every server by Fleet.connect
    elif resume.checkpoint is not None and opened.kind == "sglang":
        fleet.latest = (resume.checkpoint / "model", version)  # handed to URL-given servers by Fleet.connect
    return fleet


def lora_serving(cfg: Config) -> LoraServing | None:
    """The LoRA flags of the SGLang servers a ``rollout.sglang.lora_adapters`` run starts: its rank, its target
    modules (``all`` for ``all-linear``), and room for the ``lag_limit + 1`` versions kept resident plus one
    (SGLang counts a request without an adapter as one). None: the run publishes full weights."""
    if not cfg.rollout.sglang.lora_adapters:
        return None
    lora = cfg.trainer.lora
    targets = ("all",) if lora.target_modules == ["all-linear"] else tuple(lora.target_modules)
    return LoraServing(rank=lora.rank, slots=cfg.rollout.lag_limit + 2, target_modules=targets)


def engine_weight_dtype(cfg: Config, kind: str) -> str | None:
    """The dtype the rollout engines hold the published weights in, when the config says it is below float32:
    what a broadcast sends them in (``rollout.sglang.weight_sync.dtype``), else the built-in engines'
    ``rollout.dtype``, else the launch dtype of the SGLang servers the run starts. None: float32, or not known
    (SGLang's ``auto``, servers given by URL); the publication check then compares with the float32 weights.
    With LoRA the engines hold the merged weights rounded, which rounding the adapters and the base apart would
    not reproduce: None too."""
    r = cfg.rollout
    if cfg.trainer.lora.rank > 0:
        return None
    sync = r.sglang.weight_sync
    sent = sync.dtype if kind != "embedded" and sync.method == "distributed" else None
    if kind == "sglang":
        served = r.sglang.launch.dtype if r.sglang.launch.num_servers > 0 else "auto"
    else:
        served = r.dtype
    lowest = sent if sent not in (None, "float32") else served
    return {"bfloat16": "bfloat16", "float16": "float16", "half": "float16"}.get(lowest)


def make_trainable(model, cfg: Config, dist: DistInfo, total_steps: int):
    """The one way `train` and `sft` turn a loaded model into what they train: LoRA adapters when
    ``trainer.lora.rank`` > 0 (trainer/lora.py), FSDP2 sharding under torchrun (bf16 mixed precision on GPUs
    with ``trainer.compute_dtype=bfloat16``), training mode, then AdamW over the trainable parameters and its
    schedule. Returns (optimizer, scheduler)."""
    try:
        apply_lora(model, cfg.trainer.lora, seed=cfg.run.seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.trainer.compute_dtype == "bfloat16" and (problem := bf16_hardware_problem(dist.device)) is not None:
        if dist.device.type == "cuda":
            raise ConfigError(f"trainer.compute_dtype=bfloat16: {problem}; use float32")
        log.warning("trainer.compute_dtype=bfloat16: %s", problem)
    if dist.world_size > 1:
        shard_model(model, param_dtype=fsdp_param_dtype(cfg.trainer.compute_dtype, dist.device))
    model.train()
    return build_optimizer(model, cfg.optim, total_steps)


def frozen_reference(model, cfg: Config, dist: DistInfo) -> torch.nn.Module:
    """A frozen copy of the run's starting weights (model.path, before LoRA and before a resumed run's checkpoint
    is restored), sharded as the policy is: the reference of `objective.ref_kl_coef`. It costs one copy of the
    weights and one no-grad forward per micro-batch."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    if dist.world_size > 1:
        shard_model(reference, param_dtype=fsdp_param_dtype(cfg.trainer.compute_dtype, dist.device))
    return reference.eval()


def restore(cfg: Config, resume: Resume, model, optimizer, scheduler, rank: int) -> None:
    """Load the checkpoint the run resumes from into the model, optimizer and schedule."""
    assert resume.checkpoint is not None
    try:
        load_checkpoint(resume.checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
    except Exception as exc:  # noqa: BLE001 - damage that checkpoint_problem cannot see (inside a file)
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"resume={cfg.resume}: checkpoint {resume.checkpoint} cannot be loaded ({type(exc).__name__}: {first}); "
            f"move it aside (mv {resume.checkpoint} {resume.checkpoint}.damaged) to resume from the previous "
            "complete checkpoint"
        ) from None
    log.info("resuming %s from %s (step %d)", cfg.run.path, resume.checkpoint, resume.step)

