"""Loading, mapping, tokenizing and length-checking a large source, cold and warm; a streamed source's memory.

Part 1: a 100,000-row JSONL file in GSM8K's columns (`question`, `answer` with `#### n`), read through
`datasets` with a field mapping, the `gsm8k` answer transform and a system prompt (so every prompt goes through
the model's chat template), then tokenized and checked against the context as `trustbatch train` and
`trustbatch data` do (`load_split`, `prepare_prompts`). Each run is a fresh process; the first starts with empty
`datasets` and token caches, the second finds both.

Part 2: a 1,000,000-row file read for its first 2,000 rows, streamed (`streaming: true, max_rows: 2000`) and
not (`max_rows: 2000`): the peak resident memory and the time of each, in fresh processes.

    .venv/bin/python bench/data_loading.py                      # SmolLM2's tokenizer (make smollm2), else the tiny one
    .venv/bin/python bench/data_loading.py --rows 20000 --big-rows 200000   # smaller, to try it
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo"]
GOODS = ["apples", "marbles", "stamps", "books", "coins", "shells", "pencils", "cards"]


def write_rows(path: Path, n: int, seed: int = 0) -> None:
    """``n`` distinct two-step word problems in GSM8K's schema."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            name, goods = rng.choice(NAMES), rng.choice(GOODS)
            a, b, c = rng.randint(10, 999), rng.randint(2, 99), rng.randint(1, 9)
            question = (f"{name} has {a} {goods}. A friend gives {name} {b} more, and then {name} gives away {c}. "
                        f"How many {goods} does {name} have now? (problem {i})")  # fmt: skip
            answer = f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}\n{a + b}-{c} = <<{a + b}-{c}={a + b - c}>>{a + b - c}\n#### {a + b - c}"
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")


def worker(args: argparse.Namespace) -> None:
    """One measured load in this process; prints one JSON line."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from app.data import DataConfig, load_split
    from app.data.prepare import ModelText, prepare_prompts

    spec = {"source": args.file, "fields": {"prompt": "question", "answer": "answer"}, "answer": "gsm8k",
            "system": "Solve the problem. Put the final answer in \\boxed{}.", "task": "math"}  # fmt: skip
    if args.max_rows:
        spec["max_rows"] = args.max_rows
    if args.streaming:
        spec["streaming"] = True
    start = time.perf_counter()
    text = ModelText.from_dir(args.model) if args.model else None
    loaded_model = time.perf_counter()
    rows = load_split(DataConfig(train=[spec]), "train")
    loaded = time.perf_counter()
    tokens = 0
    if text is not None and not args.no_tokenize:
        prompts = prepare_prompts(rows, text, max_new_tokens=256, on_long_prompt="drop", source_key="data.train",
                                  source=args.file)  # fmt: skip
        tokens = sum(len(x) for x in prompts.ids)
    done = time.perf_counter()
    print(json.dumps({
        "rows": len(rows), "tokens": tokens, "tokenizer_s": loaded_model - start, "load_s": loaded - loaded_model,
        "tokenize_s": done - loaded, "total_s": done - start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))  # fmt: skip


def run_worker(*extra: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--worker", *extra], capture_output=True, text=True, env=env,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--big-rows", type=int, default=1_000_000)
    parser.add_argument("--model", default="", help="a Hugging Face directory whose tokenizer to use")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--max-rows", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--streaming", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-tokenize", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    model = args.model
    if not model:
        from app.convert import is_converted, smollm2_paths

        path = smollm2_paths()["model"]
        if is_converted(path):
            model = str(path)
        else:
            from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

            model = tempfile.mkdtemp(prefix="tiny-")
            tokenizer = build_tiny_tokenizer()
            save_model(build_tiny_model(TinyModelConfig(max_position_embeddings=1024), tokenizer), tokenizer, model)
    with tempfile.TemporaryDirectory(prefix="data-loading-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRUSTBATCH_CACHE_DIR": str(root / "cache"),
               "HF_DATASETS_CACHE": str(root / "datasets-cache"), "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
        print(f"writing {args.rows:,} rows and {args.big_rows:,} rows ...", flush=True)
        write_rows(root / "rows.jsonl", args.rows)
        write_rows(root / "big.jsonl", args.big_rows, seed=1)
        results: dict = {"model": model, "rows": args.rows, "big_rows": args.big_rows,
                         "load": os.getloadavg()[0]}  # fmt: skip
        for label in ("cold", "warm"):
            r = run_worker("--file", str(root / "rows.jsonl"), "--model", model, env=env)
            results[label] = r
            print(f"{label}: {r['rows']:,} rows, {r['tokens']:,} tokens: load {r['load_s']:.1f} s, tokenize + check "
                  f"{r['tokenize_s']:.1f} s, total {r['total_s']:.1f} s (tokenizer {r['tokenizer_s']:.1f} s), "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
        for label, extra in (("streamed", ["--streaming"]), ("whole", [])):
            r = run_worker("--file", str(root / "big.jsonl"), "--max-rows", "2000", "--no-tokenize", *extra, env=env)
            results[label] = r
            print(f"{label} ({args.big_rows:,}-row file, first 2,000 rows): {r['load_s']:.1f} s, peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
        results["big_file_mb"] = (root / "big.jsonl").stat().st_size / 2**20
        print(f"(the {args.big_rows:,}-row file is {results['big_file_mb']:.0f} MB; load average at the start "
              f"{results['load']:.2f})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
