"""Rewards: the Verifier contract, the registry of verifiers, the built-ins and the runner.

    from rewards import VerifierInput, Score, register, build_verifier, REGISTRY

    verify = build_verifier("math")                      # or "my_pkg.my_module:make_verifier"
    verify(VerifierInput(prompt="1+1?", completion="\\\\boxed{2}", reference="2", metadata={}))

Dependencies point one way: rewards imports sandbox (for the code verifier), never trainer/ or app/.
"""

from rewards import code, math, text  # noqa: F401  (register the built-ins: code, math, format, exact)
from rewards.config import RewardsConfig, VerifierSpec, check_tasks
from rewards.registry import REGISTRY, build_verifier, register
from rewards.types import Score, Verifier, VerifierFactory, VerifierInput

__all__ = [
    "REGISTRY",
    "RewardsConfig",
    "Score",
    "Verifier",
    "VerifierFactory",
    "VerifierInput",
    "VerifierSpec",
    "build_verifier",
    "check_tasks",
    "register",
]
