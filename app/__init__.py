"""trustbatch application layer: CLI, config, orchestration, rollout engines, tracking."""
