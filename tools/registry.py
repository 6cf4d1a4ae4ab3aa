"""The tool registry: built-ins by name, anything else by ``package.module:factory``, as verifiers are.

``@register("name", params=ConfigDataclass)`` on a factory ``(**params) -> Tool`` adds it to ``REGISTRY``; the
built-ins register themselves when ``tools`` is imported. `build_tools` builds every tool of the run's ``tools``
section once, at start-up, so an unknown name, a module that does not import or bad params stop the run before
any model is loaded, with the key and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from tools.config import ToolSpec
from tools.types import Tool, ToolFactory

REGISTRY: dict[str, ToolFactory] = {}
"""Registered tool factories by name."""

PARAMS: dict[str, type] = {}
"""The params dataclass each registered tool declared (checked when a config loads, before anything is built)."""

F = TypeVar("F", bound=Callable[..., Any])


def register(name: str, params: type | None = None) -> Callable[[F], F]:
    """Register a tool factory under ``name``; returns the factory unchanged."""
    if not name or ":" in name:
        raise ValueError(f"tool name {name!r} is not valid: use a non-empty name without ':'")

    def decorator(factory: F) -> F:
        REGISTRY[name] = factory
        if params is not None:
            PARAMS[name] = params
        return factory

    return decorator


def resolve_factory(name: str, key: str = "tools") -> ToolFactory:
    """The factory of a registered name or a ``package.module:factory`` path; ValueError naming ``key`` if none."""
    if ":" not in name:
        if name not in REGISTRY:
            raise ValueError(
                f"{key}: unknown tool {name!r}; registered tools: {sorted(REGISTRY)}. Use one of these, or give "
                "your own as 'package.module:factory'"
            )
        return REGISTRY[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{key}: tool {name!r} is not a valid dotted path; write it as 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import that fails for any reason is the user's to fix
        raise ValueError(
            f"{key}: tool {name!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); install "
            "its package or put its directory on PYTHONPATH"
        ) from None
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"{key}: tool {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"{key}: tool {name!r}: {attr!r} in {module_name!r} is not callable")
    return factory


def config_from_params(cls: type, params: dict[str, Any], key: str) -> Any:
    """A tool's params dataclass from ``params``; an unknown key names the valid ones."""
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"{key}.params: unknown parameter(s) {unknown}; valid parameters: {valid}")
    return cls(**params)


def check_specs(specs: list[ToolSpec]) -> None:
    """ValueError for a spec that cannot be built: unknown name, module that does not import, bad params of a
    registered tool. Cheap: a registered tool's params are checked against its dataclass, nothing is built."""
    names: dict[str, int] = {}
    for i, spec in enumerate(specs):
        key = f"tools[{i}] ({spec.name})"
        resolve_factory(spec.name, key)
        if spec.name in PARAMS:
            try:
                config_from_params(PARAMS[spec.name], dict(spec.params), key)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{key}: {exc}") from None
        if spec.call_name in names:
            raise ValueError(
                f"{key}: the tool name {spec.call_name!r} is also tools[{names[spec.call_name]}]'s; give one of "
                "them another `label` (the name the model calls it by)"
            )
        names[spec.call_name] = i


def build_tools(specs: list[ToolSpec]) -> dict[str, Tool]:
    """Every tool of the ``tools`` section, built once, by the name the model calls it by."""
    check_specs(specs)
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        key = f"tools[{i}] ({spec.name})"
        try:
            tool = resolve_factory(spec.name, key)(**spec.params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{key}: its factory refused params {dict(spec.params)}: {exc}") from None
        if not callable(tool):
            raise ValueError(f"{key}: its factory returned {type(tool).__name__}, not a callable ToolCall -> ToolResult")
        tools[spec.call_name] = tool
    return tools
