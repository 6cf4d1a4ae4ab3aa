"""Data sources read through Hugging Face `datasets`: hub ids, local files of any common kind, `save_to_disk`
folders and local dataset repositories; and what turns their columns into prompt rows.

A source (`SourceSpec`, one entry of ``data.train`` / ``data.eval``) is one of:
- ``builtin:<task>``, a task generated in code (app/data/tasks/);
- a local file: ``.jsonl`` / ``.jsonl.gz`` / ``.json``, ``.parquet``, ``.csv`` or ``.arrow``;
- a local directory: a `save_to_disk` folder, or a dataset repository's files (its ``data/`` parquet or jsonl
  files, as a hub repository lays them out);
- ``hub:<owner>/<name>`` with ``config``, ``split`` and a pinned ``revision``. With no network it stops with the
  two ways to get it: download it on a connected machine (`save_to_disk`, or the repository's files), or point the
  source at local files.

Each takes, applied in this order to every record:
1. ``fields``: the row schema's field <- the source's column (``{prompt: question, answer: answer}``); a column
   the source does not have stops the run, naming the columns it has;
2. ``template``: the prompt as a format string over the record's columns (``"Q: {question}\\nA:"``);
3. ``answer``: ``gsm8k`` keeps the number after ``####``; ``boxed`` the content of the last ``\\boxed{}``;
4. ``system``: a system message; a plain prompt becomes a chat (system, then the prompt as the user's turn);
5. ``task``: the task of every row (which verifiers score it);
6. ``format``: ``gsm8k`` and ``humaneval`` read their release's own columns (app/data/rows.py); ``rows`` is the row
   schema itself.
``max_rows`` keeps the first N valid rows; ``streaming`` reads records one at a time and stops there (it needs
``max_rows``), so a source larger than memory is never held whole. Every row is tagged with its source's name
(``metadata.data_source``): metrics and reports are per source.

A plain ``.jsonl`` / ``.parquet`` file of the row schema with none of these options is read by
`app.data.rows.load_prompts` as before (the same rows, ids and messages); everything else goes through `datasets`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from app.data.rows import (
    _MAX_REPORTED_ERRORS,
    FORMATS,
    DatasetError,
    PromptRow,
    Purpose,
    _gsm8k_row,
    _humaneval_row,
    _mbpp_row,
    _row_problems,
    _to_row,
    file_extension,
    load_prompts,
)

BUILTIN_PREFIX = "builtin:"
HUB_PREFIX = "hub:"
TARGETS = ("prompt", "messages", "answer", "tests", "task", "id", "completion")
"""Row-schema fields a source's columns can be mapped to (``fields``)."""
ANSWER_TRANSFORMS = ("as_is", "gsm8k", "boxed")
_BUILDERS = {".jsonl": "json", ".jsonl.gz": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
             ".arrow": "arrow"}  # fmt: skip
DATASET_EXTENSIONS = tuple(_BUILDERS)


@dataclass
class SourceSpec:
    """One source of ``data.train`` / ``data.eval`` (module docstring). Written as a string, it is ``source`` alone."""

    source: str = ""
    """builtin:<task>, a local file or directory, or hub:<owner>/<name>."""
    weight: float = 1.0
    """Training mixtures: this source's share of the draws is its weight over the sum of the weights."""
    name: str = ""
    """Its name in metrics, reports and `metadata.source`; default: the task, the file's stem or the hub id."""
    format: str = ""
    """rows | gsm8k | humaneval | mbpp; empty: data.format."""
    fields: dict[str, str] = field(default_factory=dict)
    """Row-schema field <- the source's column, e.g. {prompt: question, answer: answer}."""
    template: str = ""
    """The prompt as a format string over the record's columns; empty: none."""
    answer: str = "as_is"
    """as_is | gsm8k (the number after ####) | boxed (the last \\boxed{} content)."""
    system: str = ""
    """A system message put before every prompt; empty: none."""
    task: str = ""
    """The task of every row (routes it to verifiers); empty: the row's own, else math / code."""
    config: str = ""
    """Hub or local repository: the dataset's configuration (subset)."""
    split: str = ""
    """Hub or local repository: the split; default train for data.train, test for data.eval."""
    revision: str = ""
    """Hub: the commit (or tag) to read; pin it, so that the data cannot change under a run."""
    max_rows: int = 0
    """Keep the first N valid rows; 0: all of them (a built-in task: data.num_train / data.num_eval)."""
    streaming: bool = False
    """Read records one at a time and stop at max_rows (required): the source is never held whole."""

    def __post_init__(self) -> None:
        pass  # checked by `check_spec`, which knows the key to name

    @property
    def kind(self) -> Literal["builtin", "hub", "file", "directory"]:
        if self.source.startswith(BUILTIN_PREFIX):
            return "builtin"
        if self.source.startswith(HUB_PREFIX):
            return "hub"
        return "directory" if Path(self.source).is_dir() else "file"

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "builtin":
            return self.source[len(BUILTIN_PREFIX) :]
        if self.kind == "hub":
            return self.source[len(HUB_PREFIX) :]
        path = Path(self.source)
        extension = file_extension(path) or next((e for e in DATASET_EXTENSIONS if path.name.endswith(e)), "")
        return path.name[: len(path.name) - len(extension)] if extension else path.name

    @property
    def plain(self) -> bool:
        """A row-schema file (or a gsm8k / humaneval release file) with no mapping: the fast loader reads it."""
        mapping = self.fields or self.template or self.answer != "as_is" or self.system or self.task
        return self.kind == "file" and file_extension(self.source) is not None and not mapping and not (
            self.max_rows or self.streaming or self.config or self.split or self.revision)  # fmt: skip


SPEC_KEYS = tuple(f.name for f in fields(SourceSpec))


def spec_from(value: Any, key: str, default_format: str) -> SourceSpec:
    """A source as the config gives it (a string, or a mapping of SPEC_KEYS), checked; ValueError naming ``key``."""
    if isinstance(value, str):
        spec = SourceSpec(source=value)
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown}; a source takes {list(SPEC_KEYS)}")
        try:
            spec = SourceSpec(**{k: (dict(v) if k == "fields" else v) for k, v in value.items()})
        except TypeError as exc:
            raise ValueError(f"{key}: {exc}") from None
    else:
        raise ValueError(f"{key}={value!r}: give a source (builtin:<task>, a path, hub:<id>) or a mapping {{source: ...}}")
    if not spec.format:
        spec.format = default_format
    check_spec(spec, key, source_key=key if isinstance(value, str) else f"{key}.source")
    return spec


def check_spec(spec: SourceSpec, key: str, source_key: str = "") -> None:
    """ValueError naming ``key`` for a source that cannot be read, before anything is loaded (``source_key``: how
    messages name its source, ``key`` itself where the config gave the source as a string)."""
    source_key = source_key or f"{key}.source"
    if not isinstance(spec.source, str) or not spec.source:
        raise ValueError(f"{key}.source is empty; give builtin:<task>, a path, or hub:<owner>/<name>")
    if spec.format not in FORMATS:
        raise ValueError(f"{key}.format={spec.format!r}: choose one of {list(FORMATS)}")
    if spec.answer not in ANSWER_TRANSFORMS:
        raise ValueError(f"{key}.answer={spec.answer!r}: choose one of {list(ANSWER_TRANSFORMS)}")
    if isinstance(spec.weight, bool) or not isinstance(spec.weight, (int, float)) or not spec.weight >= 0:
        raise ValueError(f"{key}.weight={spec.weight!r} must be a number >= 0")
    if not isinstance(spec.max_rows, int) or spec.max_rows < 0:
        raise ValueError(f"{key}.max_rows={spec.max_rows!r} must be an integer >= 0 (0: all rows)")
    bad = sorted(set(spec.fields) - set(TARGETS))
    if bad:
        raise ValueError(f"{key}.fields: {bad} are not row fields; map the source's columns to {list(TARGETS)}")
    if any(not isinstance(c, str) or not c for c in spec.fields.values()):
        raise ValueError(f"{key}.fields: every field maps to a column name (a non-empty string)")
    if spec.streaming and not spec.max_rows:
        raise ValueError(f"{key}.streaming=true reads the first max_rows rows; set {key}.max_rows")
    if spec.kind == "builtin" and (spec.fields or spec.template or spec.streaming or spec.config or spec.revision):
        raise ValueError(f"{key}: a built-in task ({spec.source}) takes no fields, template, streaming, config or "
                         "revision; set its options in data.<task>")  # fmt: skip
    if spec.kind == "hub" and "/" not in spec.source[len(HUB_PREFIX) :]:
        raise ValueError(f"{source_key}={spec.source!r}: a hub id is hub:<owner>/<name>, e.g. hub:openai/gsm8k")
    if spec.kind == "file" and not (file_extension(spec.source) or spec.source.endswith(DATASET_EXTENSIONS)):
        raise ValueError(
            f"{source_key}={spec.source!r} is neither builtin:<task>, hub:<owner>/<name>, a directory, nor a file "
            f"ending in {' / '.join(DATASET_EXTENSIONS)}"
        )
    if spec.template:
        try:
            names = [name for _, name, _, _ in __import__("string").Formatter().parse(spec.template) if name]
        except ValueError as exc:
            raise ValueError(f"{key}.template={spec.template!r} is not a format string ({exc})") from None
        if not names:
            raise ValueError(f"{key}.template={spec.template!r} names no column; write e.g. 'Q: {{question}}'")


# ---------------------------------------------------------------------------------------------- records


def _offline_message(spec: SourceSpec, key: str, exc: Exception) -> str:
    repo = spec.source[len(HUB_PREFIX) :]
    args = ", ".join(f"{k}={v!r}" for k, v in (("name", spec.config), ("split", spec.split), ("revision", spec.revision))
                     if v)  # fmt: skip
    return (
        f"{key}: cannot read {spec.source} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). With no "
        f"network here, get it on a connected machine and bring the files over: either\n"
        f"  python -c \"import datasets; datasets.load_dataset({repo!r}{', ' + args if args else ''})"
        f".save_to_disk('DIR')\"\n"
        f"and set {key}.source to DIR, or download the repository's files (huggingface-cli download --repo-type "
        f"dataset {repo}{' --revision ' + spec.revision if spec.revision else ''} --local-dir DIR) and set "
        f"{key}.source to DIR (with its config and split)"
    )


def records(spec: SourceSpec, split: str, key: str) -> Iterator[dict]:
    """The source's records as dicts, one at a time (`datasets`); DatasetError naming ``key`` when unreadable."""
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    split = spec.split or split
    try:
        if spec.kind == "hub":
            data = datasets.load_dataset(spec.source[len(HUB_PREFIX) :], name=spec.config or None, split=split,
                                         revision=spec.revision or None, streaming=spec.streaming)  # fmt: skip
        elif spec.kind == "directory":
            path = Path(spec.source)
            if any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
                data = datasets.load_from_disk(str(path))
                if isinstance(data, datasets.DatasetDict):
                    if split not in data:
                        raise DatasetError(f"{key}: {path} has splits {sorted(data)}, not {split!r}; set {key}.split")
                    data = data[split]
            else:
                data = datasets.load_dataset(str(path), name=spec.config or None, split=split,
                                             streaming=spec.streaming)  # fmt: skip
        else:
            path = Path(spec.source)
            if not path.is_file():
                raise DatasetError(f"{key}: {path}: no such file; check the path (relative paths are from the current directory)")
            extension = next(e for e in sorted(_BUILDERS, key=len, reverse=True) if path.name.endswith(e))
            data = datasets.load_dataset(_BUILDERS[extension], data_files=str(path), split="train",
                                         streaming=spec.streaming)  # fmt: skip
    except DatasetError:
        raise
    except (ConnectionError, OSError) as exc:
        if spec.kind == "hub":
            raise DatasetError(_offline_message(spec, key, exc)) from None
        raise DatasetError(f"{key}: cannot read {spec.source} ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:  # an unknown split or config of a local repository; an empty file
        if "corresponds to no data" in str(exc):
            raise DatasetError(f"{key}: {spec.source} has no rows; point it at data with at least one row") from None
        raise DatasetError(f"{key}: cannot read {spec.source}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - datasets raises its own types (DatasetNotFoundError, ...)
        if spec.kind == "hub":
            raise DatasetError(_offline_message(spec, key, exc)) from None
        raise DatasetError(f"{key}: cannot read {spec.source} ({type(exc).__name__}: {exc})") from None
    if isinstance(data, datasets.Dataset):  # column batches: about 3x faster than formatting one row at a time
        for batch in data.iter(batch_size=1024):
            columns = list(batch.items())
            for i in range(len(columns[0][1]) if columns else 0):
                yield {k: values[i] for k, values in columns if values[i] is not None}
        return
    for record in data:
        yield {k: v for k, v in dict(record).items() if v is not None}


# ---------------------------------------------------------------------------------------------- mapping


_BOXED = re.compile(r"\\boxed\s*\{")
_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1].strip()
    return None


def map_record(spec: SourceSpec, raw: dict) -> tuple[dict, list[tuple[str, str]]]:
    """A source record -> (a record of the row schema, or of the spec's format; problems naming the fix)."""
    row = dict(raw)
    problems: list[tuple[str, str]] = []
    for target, column in spec.fields.items():
        if column not in raw:
            problems.append((target, f"maps to column {column!r}, which this record has not (columns: {sorted(raw)})"))
            continue
        row.pop(column, None)
        row[target] = raw[column]
    if spec.template:
        try:
            row["prompt"] = spec.template.format_map(raw)
            row.pop("messages", None)
        except (KeyError, IndexError) as exc:
            problems.append(("template", f"names column {exc} that this record has not (columns: {sorted(raw)})"))
    if spec.answer != "as_is" and not problems:
        text = row.get("answer")
        found = None
        if isinstance(text, str):
            match = _GSM8K_FINAL.search(text.strip()) if spec.answer == "gsm8k" else None
            found = match.group(1).replace(",", "") if match else (last_boxed(text) if spec.answer == "boxed" else None)
        if found is None:
            where = "a final '#### <number>'" if spec.answer == "gsm8k" else "a \\boxed{} answer"
            problems.append(("answer", f"has no {where} (answer: {spec.answer}); got {str(text)[:80]!r}"))
        else:
            row.setdefault("metadata", {})
            row["metadata"] = {**dict(row["metadata"]), "solution": text} if isinstance(row["metadata"], dict) else row["metadata"]
            row["answer"] = found
    if spec.system and not problems:
        if isinstance(row.get("prompt"), str):
            row["messages"] = [{"role": "system", "content": spec.system}, {"role": "user", "content": row.pop("prompt")}]
        elif isinstance(row.get("messages"), list) and not (row["messages"] and row["messages"][0].get("role") == "system"):
            row["messages"] = [{"role": "system", "content": spec.system}, *row["messages"]]
    if spec.task:
        row["task"] = spec.task
    return row, problems


def load_records(spec: SourceSpec, split: str, purpose: Purpose, key: str) -> list[PromptRow]:
    """Every valid row of a `datasets` source (module docstring); DatasetError listing the bad ones."""
    rows: list[PromptRow] = []
    errors: list[str] = []
    source = iter(records(spec, split, key))
    label = spec.label  # once: a file source's label stats the path
    for number, raw in enumerate(source, start=1):
        row, problems = map_record(spec, raw)
        if not problems and spec.format == "gsm8k":
            row, problems = _gsm8k_row(row)
        elif not problems and spec.format == "humaneval":
            row, problems = _humaneval_row(row)
        elif not problems and spec.format == "mbpp":
            row, problems = _mbpp_row(row)
        problems = problems or _row_problems(row, purpose)
        if problems:
            errors += [f"{spec.source}: record {number}: field '{name}' {why}" for name, why in problems]
            if len(errors) > 1000:  # enough to see what is wrong; a broken mapping fails every record
                break
            continue
        rows.append(_to_row(row, default_id=f"{label}:{number}", origin=f"{spec.source}: record {number}"))
        if spec.max_rows and len(rows) >= spec.max_rows:
            break
    if errors:
        shown = errors[:_MAX_REPORTED_ERRORS]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        fix = f"fix the data or {key}'s fields / template / answer / format"
        raise DatasetError(f"{key}: {spec.source}: {len(errors)} invalid field(s):\n  " + "\n  ".join(shown) + more
                           + f"\n{fix}")  # fmt: skip
    if not rows:
        raise DatasetError(f"{key}: {spec.source} has no rows{f' in split {spec.split or split!r}' if spec.kind != 'file' else ''}; "
                           "point it at data with at least one row")  # fmt: skip
    return rows


def load_file(spec: SourceSpec, purpose: Purpose) -> list[PromptRow]:
    """A plain row-schema (or gsm8k / humaneval) file, read as before (`load_prompts`)."""
    return load_prompts(spec.source, spec.format, purpose)


SOURCE_KEY = "data_source"
"""The metadata key that names a row's source (verl's name for it)."""


def tag(rows: Iterable[PromptRow], label: str) -> list[PromptRow]:
    """Each row with ``metadata.data_source`` set to its source's name."""
    out = []
    for row in rows:
        row.metadata = {**row.metadata, SOURCE_KEY: label}
        out.append(row)
    return out


def first(iterable: Iterable, n: int) -> list:
    return list(itertools.islice(iterable, n))
