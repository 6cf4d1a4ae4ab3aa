"""The verifier registry: built-ins by name, anything else by ``package.module:factory``.

``@register("name", params=ConfigDataclass)`` on a factory ``(**params) -> Verifier`` adds it to ``REGISTRY`` (and,
when given, its params dataclass to ``PARAMS``, so ``check_params`` can check a config's params without building
the verifier); the built-ins register
themselves when ``rewards`` is imported. ``build_verifier`` resolves a name (or a dotted path) and calls the factory,
so a bad name or bad parameters fail when the run starts, not on the first sample.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from rewards.types import Verifier, VerifierFactory

REGISTRY: dict[str, VerifierFactory] = {}
"""Registered verifier factories by name. Explicit on purpose: ``print(REGISTRY)`` shows what a config can name."""

PARAMS: dict[str, type] = {}
"""The params dataclass each registered verifier declared (``@register(name, params=...)``)."""

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")


def register(name: str, params: type | None = None) -> Callable[[F], F]:
    """Register a verifier factory under ``name``; returns the factory unchanged (so it stays importable).

    ``params``: the dataclass the factory builds from its keyword parameters (with ``config_from_params``), so a
    config's params are checked when it loads (``check_params``), before any verifier is built."""
    if not name or ":" in name:
        raise ValueError(f"verifier name {name!r} is not valid: use a non-empty name without ':'")

    def decorator(factory: F) -> F:
        existing = REGISTRY.get(name)
        if existing is not None and _qualified_name(existing) != _qualified_name(factory):
            raise ValueError(
                f"verifier name {name!r} is already registered by {_qualified_name(existing)}; "
                f"pick another name for {_qualified_name(factory)}"
            )
        REGISTRY[name] = factory
        if params is not None:
            PARAMS[name] = params
        return factory

    return decorator


def resolve_factory(name: str) -> VerifierFactory:
    """The factory for a registered name or a ``package.module:factory`` path; ValueError if there is none."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr:
            raise ValueError(
                f"verifier {name!r} is not a valid dotted path: write it as 'package.module:factory'"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"verifier {name!r}: cannot import module {module_name!r} ({e}); "
                "make sure the package is installed or its directory is on PYTHONPATH"
            ) from e
        factory = module
        for part in attr.split("."):
            factory = getattr(factory, part, None)
            if factory is None:
                raise ValueError(f"verifier {name!r}: module {module_name!r} has no attribute {attr!r}")
        if not callable(factory):
            raise ValueError(f"verifier {name!r}: {attr!r} in {module_name!r} is not callable")
        return factory
    if name not in REGISTRY:
        raise ValueError(
            f"unknown verifier {name!r}; registered verifiers: {sorted(REGISTRY)}. "
            "Use one of these, or give your own as 'package.module:factory'."
        )
    return REGISTRY[name]


def build_verifier(name: str, **params: Any) -> Verifier:
    """Build a verifier from a registered name or a ``package.module:factory`` path and its parameters."""
    factory = resolve_factory(name)
    verifier = factory(**params)
    if not callable(verifier):
        raise ValueError(f"verifier {name!r}: its factory returned {type(verifier).__name__}, not a callable")
    return verifier


def config_from_params(cls: type[C], params: dict[str, Any], verifier: str) -> C:
    """Build a verifier's config dataclass from ``params``; an unknown key names the valid ones."""
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"verifier {verifier!r}: unknown parameter(s) {unknown} in params; valid parameters: {valid}"
        )
    return cls(**params)


def check_params(name: str, params: dict[str, Any]) -> None:
    """ValueError if ``params`` do not build verifier ``name``'s declared params dataclass.

    Cheap (no verifier is built: math would import sympy, code would set up the sandbox). A no-op for a verifier
    that declared no dataclass, such as a ``package.module:factory``: its params are checked when it is built."""
    cls = PARAMS.get(name)
    if cls is not None:
        config_from_params(cls, dict(params), name)


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
