"""Data sources through Hugging Face `datasets` (app/data/loaders.py), mixtures, per-source routing and metrics,
decontamination, and the benchmark adapters, each on fixtures made here in the source's exact schema."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import pytest

from app.config import ConfigError, load_config
from app.data import DataConfig, DatasetError, load_split
from app.data.decontaminate import ngrams, overlaps
from app.data.loaders import last_boxed
from app.data.sources import source_sizes
from app.evaluation.benchmarks import BENCHMARKS, resolve
from app.evaluation.command import benchmark_job
from app.scoring import per_source
from app.training.sampler import MixtureSampler
from rewards import Score

REPO = Path(__file__).resolve().parents[2]
QA = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}. #### {a + b}", "level": a % 3}
      for a in range(1, 7) for b in range(1, 4)]  # fmt: skip


def mapped(source: str, **extra) -> dict:
    return {"source": source, "fields": {"prompt": "question", "answer": "answer"}, "answer": "gsm8k", **extra}


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """The same 18 question/answer records as Parquet, CSV, JSON lines, an Arrow file, a save_to_disk folder (two
    splits) and a dataset repository's layout (data/train-*.parquet, data/test-*.parquet)."""
    ds = datasets.Dataset.from_list(QA)
    out = {"parquet": tmp_path / "qa.parquet", "csv": tmp_path / "qa.csv", "jsonl": tmp_path / "qa.jsonl"}
    ds.to_parquet(str(out["parquet"]))
    ds.to_csv(str(out["csv"]), index=False)
    ds.to_json(str(out["jsonl"]))
    datasets.DatasetDict({"train": ds.select(range(12)), "test": ds.select(range(12, 18))}).save_to_disk(str(tmp_path / "disk"))
    out["disk"] = tmp_path / "disk"
    arrow = next((tmp_path / "disk" / "train").glob("*.arrow"))
    out["arrow"] = tmp_path / "qa.arrow"
    out["arrow"].write_bytes(arrow.read_bytes())
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    ds.select(range(12)).to_parquet(str(repo / "train-00000-of-00001.parquet"))
    ds.select(range(12, 18)).to_parquet(str(repo / "test-00000-of-00001.parquet"))
    out["repo"] = tmp_path / "repo"
    return out


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl", "arrow"])
def test_each_file_kind_loads_with_a_field_mapping_and_the_gsm8k_answer(files, kind):
    [row, *_] = rows = load_split(DataConfig(train=[mapped(str(files[kind]))]), "train")
    assert len(rows) == (12 if kind == "arrow" else 18)  # the Arrow file is the save_to_disk folder's train split
    assert row.prompt == "What is 1 plus 1?" and row.answer == "2"
    assert row.metadata["data_source"] == "qa" and row.metadata["solution"].endswith("#### 2")
    assert row.metadata["level"] == 1 and row.task == "math"


def test_a_save_to_disk_folder_and_a_repository_layout_give_their_splits(files):
    for name in ("disk", "repo"):
        train = load_split(DataConfig(train=[mapped(str(files[name]))]), "train")
        test = load_split(DataConfig(eval=[mapped(str(files[name]))]), "eval")  # data.eval reads the test split
        assert len(train) == 12 and len(test) == 6 and test[0].answer == str(5 + 1)
    with pytest.raises(DatasetError, match=r"has splits \['test', 'train'\], not 'validation'"):
        load_split(DataConfig(train=[mapped(str(files["disk"]), split="validation")]), "train")


def test_template_system_task_and_max_rows(files):
    spec = {"source": str(files["jsonl"]), "template": "Q: {question}\nA:", "fields": {"answer": "answer"},
            "answer": "gsm8k", "system": "Be brief.", "task": "arith", "max_rows": 5, "name": "mine"}  # fmt: skip
    rows = load_split(DataConfig(train=[spec]), "train")
    assert len(rows) == 5 and rows[0].prompt is None and rows[0].task == "arith"
    assert rows[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: What is 1 plus 1?\nA:"}]
    assert {r.metadata["data_source"] for r in rows} == {"mine"}


def test_streaming_reads_only_the_rows_it_keeps(files, monkeypatch):
    read = Counter()
    from app.data import loaders

    real = loaders.records

    def counted(spec, split, key):
        for record in real(spec, split, key):
            read["records"] += 1
            yield record

    monkeypatch.setattr(loaders, "records", counted)
    rows = load_split(DataConfig(train=[mapped(str(files["jsonl"]), streaming=True, max_rows=4)]), "train")
    assert len(rows) == 4 and read["records"] == 4


def test_the_boxed_answer_transform_takes_the_last_boxed_content():
    assert last_boxed(r"so \boxed{\frac{1}{2}} or rather \boxed{ 3 }") == "3"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c" and last_boxed("none") is None and last_boxed(r"\boxed{open") is None


@pytest.mark.parametrize(
    "train, match",
    [
        ([{"source": "builtin:arithmetic", "weight": -1}], r"data\.train\[0\]\.weight=-1 must be a number >= 0"),
        ([{"source": "builtin:arithmetic", "weight": 0}], "the weights sum to zero"),
        ([{"source": "builtin:arithmetic", "colour": "red"}], r"data\.train\[0\]: unknown key\(s\) \['colour'\]"),
        ([{"source": "x.jsonl", "fields": {"question": "q"}}], r"\['question'\] are not row fields"),
        ([{"source": "x.jsonl", "streaming": True}], r"streaming=true reads the first max_rows rows; set data\.train\[0\]\.max_rows"),
        ([{"source": "hub:gsm8k"}], "a hub id is hub:<owner>/<name>"),
        (["builtin:arithmetic", "builtin:arithmetic"], r"sources \['arithmetic'\] share a name"),
        ([{"source": "x.jsonl", "template": "no columns"}], "names no column"),
    ],
)
def test_bad_sources_stop_the_config_naming_the_key_and_the_fix(train, match):
    with pytest.raises(ConfigError, match=match):
        load_config(REPO / "configs" / "quickstart.yaml", [f"data.train={json.dumps(train)}"])


def test_a_missing_column_an_empty_source_and_an_offline_hub_id_name_the_fix(files, tmp_path):
    with pytest.raises(DatasetError, match=r"field 'answer' maps to column 'solution', which this record has not \(columns: \['answer', 'level', 'question'\]\)"):
        load_split(DataConfig(train=[{"source": str(files["parquet"]), "fields": {"prompt": "question", "answer": "solution"}}]), "train")
    empty = tmp_path / "empty.csv"
    empty.write_text("question,answer\n")
    with pytest.raises(DatasetError, match="has no rows"):
        load_split(DataConfig(train=[mapped(str(empty))]), "train")
    with pytest.raises(DatasetError) as info:  # the tests run with HF_DATASETS_OFFLINE=1: no hub
        load_split(DataConfig(train=[{"source": "hub:openai/gsm8k", "config": "main", "revision": "abc123"}]), "train")
    text = str(info.value)
    assert "save_to_disk('DIR')" in text and "--revision abc123" in text and "set data.train[0].source to DIR" in text


def test_a_mixture_draws_each_source_in_proportion_deterministically_and_resumes():
    groups = [list(range(0, 50)), list(range(50, 60)), list(range(60, 90))]
    draws = MixtureSampler(groups, [5.0, 1.0, 4.0], seed=3).take(10_000)
    share = Counter(next(s for s, g in enumerate(groups) if i in g) for i in draws)
    assert abs(share[0] / 10_000 - 0.5) < 0.02 and abs(share[1] / 10_000 - 0.1) < 0.01 and abs(share[2] / 10_000 - 0.4) < 0.02
    assert MixtureSampler(groups, [5.0, 1.0, 4.0], seed=3).take(10_000) == draws
    assert MixtureSampler(groups, [5.0, 1.0, 4.0], seed=4).take(100) != draws[:100]
    resumed = MixtureSampler(groups, [5.0, 1.0, 4.0], seed=3, cursor=6_000)
    assert resumed.take(4_000) == draws[6_000:]
    # Within a source, seeded epochs: every row of the small source once before any twice.
    small = [i for i in draws if 50 <= i < 60]
    assert sorted(small[:10]) == list(range(50, 60))


def test_rows_carry_their_source_for_routing_and_per_source_metrics(files):
    cfg = DataConfig(train=[mapped(str(files["jsonl"]), name="qa", weight=2), {"source": "builtin:arithmetic", "weight": 1}],
                     num_train=30)  # fmt: skip
    rows = load_split(cfg, "train")
    groups = source_sizes(rows, cfg.sources("train"))
    assert [len(g) for g in groups] == [18, 30] and rows[groups[1][0]].metadata["data_source"] == "arithmetic"
    scores = [Score(1.0 if i % 2 else 0.0, bool(i % 2), {}, None) for i in range(len(rows))]
    metrics = per_source(rows, scores)
    assert set(metrics) == {f"reward/source/{s}/{m}" for s in ("qa", "arithmetic") for m in ("mean", "correct")}
    assert per_source(rows[:18], scores[:18]) == {}  # one source: nothing per source


def test_a_source_whose_task_no_verifier_serves_stops_the_run_naming_it(tmp_path, files):
    from app.training.setup import check_run_tasks

    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      [f"data.train={json.dumps([mapped(str(files['jsonl']), task='trivia', name='quiz')])}"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"data source 'quiz' .* have no verifier.*Or set the source's `task`"):
        check_run_tasks(cfg, load_split(cfg.data, "train"))


def test_decontamination_finds_a_planted_overlap():
    from app.data.rows import PromptRow

    long = "the quick brown fox jumps over the lazy dog while seven sleepy cats watch from the garden wall"
    train = [PromptRow(f"Q{i}: unrelated text number {i} about apples and pears", None, "1", None, "math", f"t{i}",
                       metadata={"data_source": "web"}) for i in range(50)]  # fmt: skip
    train.append(PromptRow(f"Rewritten: {long.upper()}!", None, "1", None, "math", "leak", metadata={"data_source": "web"}))
    evaluation = [PromptRow(long, None, "1", None, "math", "e0"), PromptRow("short one", None, "1", None, "math", "e1")]
    found = overlaps(train, {"data.eval": evaluation, "gsm8k": []})
    assert found.counts == {("web", "data.eval"): 1} and found.rows == {50} and found.examples[("web", "data.eval")] == ["leak"]
    assert "web: 1 row(s) share a 13-gram with data.eval (e.g. leak)" in found.lines()
    assert len(ngrams("a b c")) == 1 and ngrams("") == set()  # shorter than 13 words: the text is one n-gram


# ---------------------------------------------------------------------------------------------- benchmarks


HUB_SCHEMAS = {
    "gsm8k": {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    "math500": {"problem": "What is $1+1$?", "solution": r"It is $\boxed{2}$.", "answer": "2", "subject": "Algebra",
                "level": 1, "unique_id": "test/algebra/1.json"},
    "aime24": {"id": 60, "problem": "Find the remainder of 2024 divided by 1000.", "solution": "24", "answer": "24",
               "url": "https://example.org", "year": "2024"},
    "aime25": {"problem": "Compute 6 times 7.", "answer": "42", "id": "0"},
    "amc23": {"id": 0, "question": "What is 10 minus 3?", "answer": 7.0, "url": "https://example.org"},
    "mbpp": {"source_file": "x.py", "task_id": 2, "prompt": "Write a function add(a, b) that returns their sum.",
             "code": "def add(a, b):\n    return a + b", "test_imports": [], "test_list": ["assert add(1, 2) == 3",
             "assert add(0, 0) == 0"]},
    "humaneval": {"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Sum."""\n', "entry_point": "add",
                  "canonical_solution": "    return a + b\n", "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"},
}  # fmt: skip


def test_every_benchmark_reads_its_mirror_in_the_hubs_schema(tmp_path):
    """Each entry's adapter on a record in its hub dataset's own columns, read from a local mirror."""
    assert set(HUB_SCHEMAS) == set(BENCHMARKS)
    for name, record in HUB_SCHEMAS.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(record) + "\n")
    for bench in resolve(sorted(BENCHMARKS), tmp_path):
        job = benchmark_job(load_config(None, []).eval_job, bench)
        [row] = load_split(job.data, "eval")
        assert row.task == bench.task and job.rewards.verifiers[0].tasks == [bench.task], bench.name
        assert row.metadata["data_source"] == bench.name
        if bench.task == "math":
            assert row.answer == {"gsm8k": "7", "math500": "2", "aime24": "24", "aime25": "42", "amc23": "7.0"}[bench.name]
        else:
            assert row.tests and "add" in json.dumps(row.tests)
        assert job.eval.samples_per_prompt == bench.samples and job.eval.temperature == bench.temperature
    assert BENCHMARKS["aime24"].metric == "avg@16 (T = 0.6), pass@8" and BENCHMARKS["gsm8k"].metric == "pass@1 (greedy)"
    with pytest.raises(ValueError, match=r"unknown benchmark\(s\) \['gsm9k'\]"):
        resolve(["gsm9k"])
