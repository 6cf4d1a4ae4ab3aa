"""The dependency rule of the README's layout section, enforced on every import in the tree.

Every `import` and `from ... import` of every module under app/, trainer/, rewards/, tools/ and sandbox/ is read with
`ast` (imports inside functions and under `TYPE_CHECKING` included, relative imports resolved), and checked:

- nothing outside app/ imports `app`, and nothing imports `app.cli` (the top of the tree);
- `rewards` and `sandbox` never import `app` or `trainer`; `sandbox` never imports `rewards`;
- `tools` (the model's tools) imports only `sandbox` of the tree: never `app`, `trainer` or `rewards`;
- `trainer/objective.py` and `trainer/advantages.py` import only the standard library and torch;
- `app/rollout` imports `trainer` only through the joint (`app/rollout/joint.py`), and never `app.training`,
  `app.serving` or `app.evaluation` (it talks to servers over HTTP and to the trainer through the joint);
- `app/serving` never imports `app.training` or `trainer.step`/`trainer.optim` (serving does not train);
- `app/evaluation` never imports `app.config`: it takes the sections it reads (`EvalJob`), so it sits under the config.

- `app/data` imports nothing of app/ but `app.sampling` (it is the bottom of the application);
- no import circles: the graph of every import between modules (lazy ones included) has no cycle;
- no file over 700 lines;
- engines are started in one place: outside app/rollout, only app/engines.py constructs a server process
  (`LocalServerProcess`, `SGLangServerProcess`, `launch_servers`), an `SGLangClient` or an
  `EmbeddedEngine.from_pretrained`.

The checker is also run on a small tree that breaks each rule, so a rule that can no longer fire fails here.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "trainer", "rewards", "sandbox", "tools")
JOINT = "app.rollout.joint"
PURE = ("trainer.objective", "trainer.advantages")
MAX_LINES = 700
ENGINE_OPENER = "app.engines"
STARTERS = ("LocalServerProcess", "SGLangServerProcess", "launch_servers", "SGLangClient")
"""Calls that start an engine: only the opener (and app/rollout, where they are defined) makes them."""


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
    if within(src, "tools") and (within(dst, "trainer") or within(dst, "rewards")):
        rules.append("tools imports only sandbox of the tree")
    if within(src, "sandbox") and within(dst, "tools"):
        rules.append("sandbox never imports tools")
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
    if within(src, "app.evaluation") and within(dst, "app.config"):
        rules.append("app/evaluation never imports app.config (it takes the sections it reads: EvalJob)")
    if within(src, "app.data") and within(dst, "app") and not (within(dst, "app.data") or dst == "app.sampling"):
        rules.append("app/data imports nothing of app/ but app.sampling")
    return rules


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each a list of module names."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.importer != e.imported:
            graph.setdefault(e.importer, set()).add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def long_files(root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)}: {n} lines"
        for package in PACKAGES
        for path in sorted((root / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def engine_starts(root: Path) -> list[str]:
    """Calls that start an engine outside app/engines.py and app/rollout."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = module_name(path, root)
            if name == ENGINE_OPENER or within(name, "app.rollout"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                from_pretrained = (
                    called == "from_pretrained" and isinstance(func.value, ast.Name) and func.value.id == "EmbeddedEngine"
                )
                if called in STARTERS or from_pretrained:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {name} starts an engine ({called})")
    return out


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


def test_no_import_circles():
    assert cycles(walk(ROOT)) == []


def test_no_file_is_over_700_lines():
    assert long_files(ROOT) == []


def test_engines_are_started_only_by_the_opener():
    assert engine_starts(ROOT) == []
    # The opener is where they are: the rule looks at the right names.
    opener = (ROOT / "app" / "engines.py").read_text()
    assert all(name in opener for name in ("LocalServerProcess(", "launch_servers(", "SGLangClient(", "EmbeddedEngine.from_pretrained("))


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
        "app/data/__init__.py": "from app.config import Config\nfrom app.sampling import describe\n",
        "app/config.py": "def f():\n    import app.data\n",
        "app/sampling.py": "",
        "app/evaluation/run.py": "from app.rollout.sglang import SGLangClient\nclient = SGLangClient(cfg)\n",
        "app/evaluation/command.py": "from app.config import Config\n",
        "app/engines.py": "engine = EmbeddedEngine.from_pretrained(path)\n",  # allowed: the opener
        "app/long.py": "x = 1\n" * (MAX_LINES + 1),
        "tools/__init__.py": "from rewards import Score\nfrom sandbox import execute\n",  # the second is allowed
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
        "app/data/__init__.py:1: app.data imports app.config (app/data imports nothing",
        "tools/__init__.py:1: tools imports rewards (tools imports only sandbox",
        "app/evaluation/command.py:1: app.evaluation.command imports app.config (app/evaluation never imports",
    ]
    for prefix in expected:
        assert any(v.startswith(prefix) for v in found), (prefix, found)
    assert len(found) == len(expected), found
    assert not any(
        v.startswith(("trainer/advantages.py", "app/rollout/joint.py", "rewards/math.py:2")) for v in found
    )
    assert cycles(walk(tmp_path)) == [["app.config", "app.data"]]
    assert long_files(tmp_path) == [f"app/long.py: {MAX_LINES + 1} lines"]
    assert engine_starts(tmp_path) == ["app/evaluation/run.py:2: app.evaluation.run starts an engine (SGLangClient)"]
