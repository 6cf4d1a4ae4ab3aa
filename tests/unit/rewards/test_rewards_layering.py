"""rewards/ depends only on sandbox/ (app -> trainer -> rewards -> sandbox), and `import rewards` stays cheap."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_rewards_never_imports_app_or_trainer():
    for path in sorted((ROOT / "rewards").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in {"app", "trainer"}, f"{path.name} imports {name}"


def test_import_rewards_does_not_load_sympy():
    code = "import sys, rewards; print('sympy' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
