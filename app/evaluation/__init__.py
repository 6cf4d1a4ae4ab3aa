"""Evaluation: one path for training's held-out evaluations and for `trustbatch eval`.

- config.py: `EvalConfig`, the one settings type (the config section ``eval``; `trustbatch eval`'s options set it).
- metrics.py: accuracy and pass@k with standard errors clustered by prompt, paired gains.
- run.py: `sample_and_score` through any engine, the one result type `EvalResult`, progress reports.
- held_out.py: `HeldOut`, the evaluations of a training run.
- command.py: `trustbatch eval` (a model reference through an engine to a result); report.py: its table, JSON
  and MLflow run.

Import from the modules (this file imports none: app/config.py takes `EvalConfig` from here, and the command
module takes the root config from there).
"""
