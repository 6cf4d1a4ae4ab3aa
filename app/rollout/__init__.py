"""Rollout engines behind one protocol (see base.py)."""

from app.rollout.base import Completion, RolloutEngine, SamplingParams, WeightSource

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "WeightSource"]
