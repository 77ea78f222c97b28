"""A benchmark as data: a YAML file names its files, how a row becomes a context and its choices, the
answer, the few-shot split and its delimiters (lm-evaluation-harness's task fields: doc_to_text,
doc_to_choice, doc_to_target, target_delimiter, fewshot_delimiter, description). Templates are
rendered in jinja2's immutable sandbox: a benchmark file is data, never code.

Shipped: piqa, mmlu (the letter form, as lm-evaluation-harness's `mmlu`), mmlu_cloze (each choice's
text scored, as lighteval's MMLU), and mmlu_<subject> / mmlu_cloze_<subject> for one subject. A user's
own benchmark is a YAML file beside a JSONL or CSV of rows (`tfcli eval my_bench.yaml`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from ..errors import UserError

SHIPPED_DIR = Path(__file__).parent / "tasks"
FIELDS = {
    "name",
    "data",
    "files",
    "format",
    "columns",
    "split",
    "fewshot_split",
    "context",
    "choices",
    "answer",
    "target_delimiter",
    "fewshot_delimiter",
    "description",
    "subjects",
    "labels",
    "version",
}


@dataclass(frozen=True)
class Benchmark:
    """One benchmark (or one subject of a benchmark with subjects, e.g. mmlu_anatomy)."""

    name: str
    files: dict[str, str]  # split -> file under the data directory; {subject} is filled in
    context: str  # jinja2: a row -> the question's text (lm-evaluation-harness's doc_to_text)
    choices: list[str]  # jinja2 each: a row -> the choices' texts (doc_to_choice)
    answer: str  # jinja2: a row -> the correct choice, as its index or its text (doc_to_target)
    split: str = "test"  # the split scored
    fewshot_split: str = ""  # where --few-shot K takes its K solved examples (the first K rows)
    format: str = "jsonl"  # jsonl | csv (csv: `columns` names the columns of a file without a header)
    columns: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # split -> a file of one label per row (PIQA)
    target_delimiter: str = " "  # between the context and a choice
    fewshot_delimiter: str = "\n\n"  # between the solved examples
    description: str = ""  # jinja2: a header before the examples, e.g. MMLU's subject line
    data: str = ""  # where the files are when --data is not given (a directory)
    subjects: dict[str, str] = field(default_factory=dict)  # subject -> category (a benchmark with subjects)
    subject: str = ""  # set on one subject's Benchmark
    version: float = 1.0  # the benchmark's version, as lm-evaluation-harness's results file records it

    @property
    def parts(self) -> list[Benchmark]:
        """The subjects as Benchmarks of their own (a benchmark without subjects is its one part)."""
        if not self.subjects or self.subject:
            return [self]
        return [replace(self, name=f"{self.name}_{s}", subject=s) for s in self.subjects]

    def path(self, root: Path, split: str) -> Path:
        return root / self.files[split].format(subject=self.subject)


def shipped() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def is_benchmark(name: str) -> bool:
    """Whether `tfcli eval NAME` names benchmarks (piqa, mmlu, mmlu_anatomy, a .yaml, or a list with one of
    them) rather than a task: a list that names any benchmark is read as benchmarks, and an unknown
    name in it is then one line listing the benchmarks."""
    names = shipped()
    parts = [p.strip() for p in name.split(",") if p.strip()]
    return any(p.endswith((".yaml", ".yml")) or p in names or any(p.startswith(s + "_") for s in names) for p in parts)


def _known(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def load(name: str) -> Benchmark:
    """A shipped benchmark, one subject of one (mmlu_anatomy), or a user's YAML file."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
        if not path.is_file():
            raise UserError(f"{name}: no such benchmark file")
        return _from_yaml(path)
    if (SHIPPED_DIR / f"{name}.yaml").is_file():
        return _from_yaml(SHIPPED_DIR / f"{name}.yaml")
    for parent in sorted(shipped(), key=len, reverse=True):  # mmlu_cloze_anatomy before mmlu_...
        if name.startswith(parent + "_"):
            bench, subject = _from_yaml(SHIPPED_DIR / f"{parent}.yaml"), name[len(parent) + 1 :]
            if subject in bench.subjects:
                return replace(bench, name=name, subject=subject)
            raise UserError(f"{parent} has no subject {subject!r} (it has {_known(sorted(bench.subjects))})")
    raise UserError(f"unknown benchmark {name!r} (shipped: {_known(shipped())}; or a .yaml file of your own)")


def _from_yaml(path: Path) -> Benchmark:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a benchmark file is a mapping of fields ({', '.join(sorted(FIELDS))})")
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        raise UserError(f"{path}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(FIELDS))})")
    missing = [k for k in ("files", "context", "choices", "answer") if k not in raw]
    if missing:
        raise UserError(f"{path}: {missing[0]} is missing (a benchmark names its files, context, choices and answer)")
    _check_types(path, raw)
    raw.setdefault("name", path.stem)
    if raw.get("data", "") and not Path(raw["data"]).is_absolute():
        raw["data"] = str((path.parent / raw["data"]).resolve())
    bench = Benchmark(**raw)
    if bench.split not in bench.files:
        raise UserError(f"{path}: split {bench.split!r} is not among its files ({', '.join(bench.files)})")
    if bench.format == "csv" and not bench.columns:
        raise UserError(f"{path}: format csv needs columns, the names of the file's columns in order")
    return bench


_MAPPINGS = ("files", "labels", "subjects")  # of names to texts
_LISTS = ("choices", "columns")  # of texts


def _check_types(path: Path, raw: dict) -> None:
    """Each field of a benchmark file of the kind it must be, named in one line when it is not (a
    string of choices would be scored character by character)."""
    for key, value in raw.items():
        if key in _MAPPINGS:
            ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
            ok = ok and (bool(value) or key != "files")
            kind = "a mapping of names to file names" if key != "subjects" else "a mapping of subjects to categories"
        elif key in _LISTS:
            ok = (
                isinstance(value, list) and all(isinstance(v, str) for v in value) and (bool(value) or key != "choices")
            )
            kind = "a list of templates, one per choice" if key == "choices" else "a list of column names"
        elif key == "version":
            ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        else:
            ok, kind = isinstance(value, str), "a text"
        if not ok:
            raise UserError(f"{path}: {key} must be {kind}, got {value!r:.80}")
    if raw.get("format", "jsonl") not in ("jsonl", "csv"):
        raise UserError(f"{path}: format {raw['format']!r} is not one tfcli reads (jsonl or csv)")


@dataclass(frozen=True)
class Question:
    """One row as the scorer sees it: the context (few-shot examples and description included), the
    choices' texts, the correct one's index."""

    context: str
    choices: list[str]
    gold: int
    doc: dict = field(default_factory=dict)  # the row it was rendered from (--log-samples writes it)
    delimiter: str = " "  # between the context and a choice


def _environment():
    import jinja2
    import jinja2.sandbox

    # StrictUndefined: a field no row has is an error naming the row, not an empty text scored anyway
    return jinja2.sandbox.ImmutableSandboxedEnvironment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


@dataclass(frozen=True)
class Row:
    """A row of a split, and where it is (for the one line that names a bad one)."""

    fields: dict
    where: str  # FILE line N (JSON Lines), FILE row N (CSV)


def read_rows(bench: Benchmark, root: Path, split: str) -> list[Row]:
    """The rows of one split: JSON Lines (one object a line) or CSV, with a labels file joined in where
    it has one. A missing or unreadable file, a line that is not a JSON object, an empty split: one line."""
    path = bench.path(root, split)
    if not path.is_file():
        raise UserError(f"{bench.name}: {path} is missing (the {split} split: {bench.files[split]} under --data)")
    text = _text(path)
    if bench.format == "csv":
        lines = [line for line in csv.reader(text.splitlines()) if line]
        rows = [Row(dict(zip(bench.columns, line)), f"{path} row {i}") for i, line in enumerate(lines, 1)]
    else:
        rows = [
            Row(_object(line, path, i), f"{path} line {i}")
            for i, line in enumerate(text.splitlines(), 1)
            if line.strip()
        ]
    if not rows:
        raise UserError(f"{bench.name}: {path} has no rows (the {split} split)")
    if split in bench.labels:
        labels_path = root / bench.labels[split]
        if not labels_path.is_file():
            raise UserError(f"{bench.name}: {labels_path} is missing (the {split} split's labels, one a line)")
        labels = _text(labels_path).split()
        if len(labels) != len(rows):
            raise UserError(f"{bench.name}: {len(rows)} rows in {path} but {len(labels)} labels in {labels_path}")
        rows = [Row({**row.fields, "label": label}, row.where) for row, label in zip(rows, labels)]
    return rows


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise UserError(f"{path} line {line}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _object(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {number}: not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(row, dict):
        raise UserError(f"{path} line {number}: a row is a JSON object of fields, got {type(row).__name__}")
    return row


class Renderer:
    """A benchmark's templates compiled once; a row -> its context, choices and answer."""

    def __init__(self, bench: Benchmark):
        import jinja2

        env = _environment()
        try:
            self.context = env.from_string(bench.context)
            self.choices = [env.from_string(c) for c in bench.choices]
            self.answer = env.from_string(bench.answer)
            self.description = env.from_string(bench.description)
        except jinja2.TemplateError as e:
            raise UserError(f"{bench.name}: a template does not parse ({e})") from None
        self.bench = bench
        self.subject_name = bench.subject.replace("_", " ")

    def _render(self, template, row: Row) -> str:
        import jinja2

        try:
            return template.render(**row.fields, subject=self.subject_name)
        except jinja2.TemplateError as e:
            fields = ", ".join(row.fields) or "no fields"
            raise UserError(f"{self.bench.name}: {row.where}: {e} (the row has {fields})") from None

    def question(self, row: Row) -> tuple[str, list[str], int]:
        choices = [self._render(c, row) for c in self.choices]
        empty = [i for i, c in enumerate(choices) if not c]
        if empty:  # acc_norm divides a choice's log-likelihood by its length
            raise UserError(f"{self.bench.name}: {row.where}: choice {empty[0] + 1} is empty")
        answer = self._render(self.answer, row).strip()
        gold = int(answer) if answer.isdigit() else choices.index(answer) if answer in choices else -1
        if not 0 <= gold < len(choices):
            raise UserError(
                f"{self.bench.name}: {row.where}: answer {answer!r} is neither a choice's index nor one of {choices}"
            )
        return self._render(self.context, row), choices, gold

    def header(self) -> str:
        return self._render(self.description, Row({}, "the description"))


def questions(bench: Benchmark, root: Path, few_shot: int, limit: int = 0) -> list[Question]:
    """The scored split's questions, each with the description and the first `few_shot` solved rows of
    the few-shot split before it (lm-evaluation-harness's first_n sampler)."""
    render = Renderer(bench)
    rows = read_rows(bench, root, bench.split)
    rows = rows[:limit] if limit else rows
    shots = ""
    if few_shot > 0:
        if not bench.fewshot_split or bench.fewshot_split not in bench.files:
            raise UserError(f"{bench.name} has no few-shot split; score it 0-shot")
        solved = read_rows(bench, root, bench.fewshot_split)
        if few_shot > len(solved):
            raise UserError(f"--few-shot {few_shot}: {bench.name}'s few-shot split has {len(solved)} rows")
        for row in solved[:few_shot]:
            context, choices, gold = render.question(row)
            shots += context + bench.target_delimiter + choices[gold] + bench.fewshot_delimiter
    header = render.header()
    out = []
    for row in rows:
        context, choices, gold = render.question(row)
        out.append(Question(header + shots + context, choices, gold, row.fields, bench.target_delimiter))
    return out


def data_root(bench: Benchmark, data: str | None, option: str = "--data") -> Path:
    """The directory of the benchmark's files: --data itself, or the one of its subdirectories that
    holds them (so `tfcli eval piqa,mmlu --data bench/` finds bench/piqa and bench/mmlu). `option`: what
    the user named it with (--data, or train.eval_tasks_data inside training)."""
    where = data or bench.data
    if not where:
        raise UserError(f"{bench.name}: give {option}, the directory holding {', '.join(bench.files.values())}")
    root = Path(where)
    if not root.is_dir():
        raise UserError(f"{option} {where}: not a directory (a benchmark's data is a directory of its files)")
    part = bench.parts[0]
    if part.path(root, bench.split).is_file():
        return root
    holding = [d for d in sorted(root.iterdir()) if d.is_dir() and part.path(d, bench.split).is_file()]
    return holding[0] if holding else root  # none: reading the split names the missing file
