"""The dependency rule of the README's layout section, enforced on every import in the tree.

Every `import` and `from ... import` of every module under app/, trainer/, rewards/ and sandbox/ is read with
`ast` (imports inside functions and under `TYPE_CHECKING` included, relative imports resolved), and checked:

- nothing outside app/ imports `app`, and nothing imports `app.cli` (the top of the tree);
- `rewards` and `sandbox` never import `app` or `trainer`; `sandbox` never imports `rewards`;
- `trainer/objective.py` and `trainer/advantages.py` import only the standard library and torch;
- `app/rollout` imports `trainer` only through the joint (`app/rollout/joint.py`), and never `app.training`,
  `app.serving` or `app.evaluation` (it talks to servers over HTTP and to the trainer through the joint);
- `app/serving` never imports `app.training` or `trainer.step`/`trainer.optim` (serving does not train).

The checker is also run on a small tree that breaks each rule, so a rule that can no longer fire fails here.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "trainer", "rewards", "sandbox")
JOINT = "app.rollout.joint"
PURE = ("trainer.objective", "trainer.advantages")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str  # file:line


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[Edge]:
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            edges += [Edge(name, alias.name, where) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # `from app.rollout import fleet` imports the module app.rollout.fleet when there is one.
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (root / Path(*sub.split("."))).with_suffix(".py").is_file() or (
                    root / Path(*sub.split(".")) / "__init__.py"
                ).is_file()
                edges.append(Edge(name, sub if is_module else target, where))
    return edges


def walk(root: Path) -> list[Edge]:
    edges = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            edges += imports_of(path, root)
    return edges


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def broken_rules(src: str, dst: str) -> list[str]:
    """The rules an import of module `dst` by module `src` breaks."""
    top = dst.split(".")[0]
    rules = []
    if within(dst, "app.cli"):
        rules.append("nothing imports the CLI")
    if within(dst, "app") and not within(src, "app"):
        rules.append("nothing outside app/ imports app")
    if (within(src, "rewards") or within(src, "sandbox")) and within(dst, "trainer"):
        rules.append("rewards and sandbox never import trainer")
    if within(src, "sandbox") and within(dst, "rewards"):
        rules.append("sandbox never imports rewards")
    if src in PURE and top not in sys.stdlib_module_names and top not in ("torch", "__future__"):
        rules.append("the pure algorithm modules import only the standard library and torch")
    if within(src, "app.rollout"):
        if within(dst, "trainer") and src != JOINT:
            rules.append(f"app/rollout imports trainer only through {JOINT}")
        rules += [
            f"app/rollout never imports {o}"
            for o in ("app.training", "app.serving", "app.evaluation")
            if within(dst, o)
        ]
    if within(src, "app.serving"):
        rules += [
            f"app/serving never imports {o}"
            for o in ("app.training", "trainer.step", "trainer.optim")
            if within(dst, o)
        ]
    return rules


def violations(edges: list[Edge]) -> list[str]:
    return [
        f"{e.where}: {e.importer} imports {e.imported} ({rule})"
        for e in edges
        for rule in broken_rules(e.importer, e.imported)
    ]


def test_the_tree_keeps_the_dependency_rule():
    edges = walk(ROOT)
    importers = {e.importer for e in edges}
    # The walk saw the whole tree: every package, the pure modules, and the rollout side and its joint.
    for name in (*PACKAGES, *PURE, "app.rollout.fleet", "app.training.loop"):
        assert any(within(i, name) for i in importers), f"no imports read from {name}"
    assert len(edges) > 300
    assert violations(edges) == []


def test_the_joint_is_where_rollout_meets_the_trainer():
    edges = walk(ROOT)
    joint = [e for e in edges if e.importer == JOINT and within(e.imported, "trainer")]
    assert joint, f"{JOINT} should be the one app/rollout module that imports trainer"


def test_each_rule_fires_on_a_tree_that_breaks_it(tmp_path):
    files = {
        "trainer/objective.py": "import numpy\nfrom app.config import Config\n",
        "trainer/advantages.py": "import math\nimport torch\n",  # allowed
        "rewards/math.py": "from trainer.model import load_model\nfrom . import registry\n",
        "rewards/registry.py": "",
        "sandbox/__init__.py": "def f():\n    from rewards import Score\n",
        "app/__init__.py": "",
        "app/cli.py": "",
        "app/rollout/__init__.py": "",
        "app/rollout/fleet.py": "from app.training import loop\nfrom trainer.weights import plan_buckets\n",
        "app/rollout/joint.py": "from trainer.weights import plan_buckets\n",  # allowed
        "app/training/__init__.py": "",
        "app/training/loop.py": "from app import cli\n",
        "app/serving/__init__.py": "",
        "app/serving/openai.py": "from ..training.loop import run\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(walk(tmp_path))
    expected = [
        "trainer/objective.py:1: trainer.objective imports numpy",
        "trainer/objective.py:2: trainer.objective imports app.config (nothing outside app/",
        "trainer/objective.py:2: trainer.objective imports app.config (the pure",
        "rewards/math.py:1: rewards.math imports trainer.model",
        "sandbox/__init__.py:2: sandbox imports rewards (sandbox never",
        "app/rollout/fleet.py:1: app.rollout.fleet imports app.training.loop",
        "app/rollout/fleet.py:2: app.rollout.fleet imports trainer.weights",
        "app/training/loop.py:1: app.training.loop imports app.cli",
        "app/serving/openai.py:1: app.serving.openai imports app.training.loop",
    ]
    for prefix in expected:
        assert any(v.startswith(prefix) for v in found), (prefix, found)
    assert len(found) == len(expected), found
    assert not any(
        v.startswith(("trainer/advantages.py", "app/rollout/joint.py", "rewards/math.py:2")) for v in found
    )
