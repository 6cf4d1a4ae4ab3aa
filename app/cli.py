"""`trustbatch` command line: argument plumbing only; the work lives in app/loop.py and friends."""

from __future__ import annotations

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
    from app.loop import run, summary_lines

    try:
        summary = run(cfg)
    except (DatasetError, ConfigError) as exc:
        _fail(str(exc))
    if int(os.environ.get("RANK", "0")) == 0:
        for line in summary_lines(summary):
            typer.echo(line)
        typer.echo(f"run directory: {cfg.run.path} (summary.json, training.png, config.yaml)")


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

    from app.bootstrap import bootstrap as build

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
) -> None:
    """Serve a model on CPU behind SGLang's native HTTP API (/generate, /update_weights_from_disk, ...)."""
    _setup_logging()
    from app.rollout.local_server import serve

    try:
        serve(
            model,
            host,
            port,
            max_batch_size=max_batch_size,
            batch_window_ms=batch_window_ms,
            weight_version=weight_version,
        )
    except ValueError as exc:
        _fail(str(exc))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
