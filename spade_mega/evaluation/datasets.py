"""Question-answer suites: items read from a JSONL or Parquet file with configurable fields, or a built-in suite.

Every problem with a suite's data (no file, a field that is not there, an unreadable line) is a
:class:`~spade_mega.config.errors.ConfigError` naming the suite's setting (``eval.suites[i].path``,
``...question_field``) and the place in the file, raised when the suite is loaded: before the run's first rollout.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import EvalSuiteConfig
from spade_mega.evaluation.code import parse_tests
from spade_mega.evaluation.scoring import reference_letter

BUILTIN = ("arithmetic",)
_LETTERS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class QAItem:
    """One question: its id (the id field, or its position), the question text, the reference answer, options."""

    item_id: str
    question: str
    answer: str
    choices: tuple[str, ...] = ()


def builtin_arithmetic(count: int = 32) -> list[QAItem]:
    """Small integer sums and products, the same on every machine (a fixed generator): the CPU demo's suite, which a
    trained model answers and a random one does not."""
    rng = random.Random(20260)
    items = []
    for i in range(count):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        op, value = (("+", a + b), ("*", a * b), ("-", a - b))[i % 3]
        items.append(QAItem(f"arithmetic-{i}", f"What is {a} {op} {b}?", str(value)))
    return items


def _field(record: dict[str, Any], name: str, setting: str, where: str) -> Any:
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(setting, f"{where} has no field {name!r} (its fields: {', '.join(sorted(record))}); set "
                                       f"{setting.rsplit('.', 1)[-1]} to the field holding it")
        value = value[part]
    return value


def _records(path: Path, fmt: str, setting: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, record) of every row."""
    if fmt == "jsonl":
        try:
            lines = path.read_bytes().splitlines()
        except OSError as exc:
            raise ConfigError(setting, f"cannot read {path} ({exc.strerror or exc})") from None
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(setting, f"{path}:{number}: not a JSON object per line ({exc})") from None
            if not isinstance(record, dict):
                raise ConfigError(setting, f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            yield f"{path}:{number}", record
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(setting, f"{path}: not a readable Parquet file ({exc})") from None
    for number, record in enumerate(rows, 1):
        yield f"{path}[row {number}]", record


def _format(suite: EvalSuiteConfig, setting: str) -> str:
    if suite.format != "auto":
        return suite.format
    if suite.path.startswith("builtin:"):
        return "builtin"
    suffix = Path(suite.path).suffix
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise ConfigError(setting, f"cannot tell the format of {suite.path!r} from its suffix; name a .jsonl or .parquet "
                               "file, or set format: jsonl|parquet")


def load_items(suite: EvalSuiteConfig, where: str = "eval.suites[0]") -> list[QAItem]:
    """The items of a ``qa`` suite, at most ``max_items`` (the first ones, in file order)."""
    setting = f"{where}.path"
    fmt = _format(suite, setting)
    if fmt == "builtin":
        name = suite.path.removeprefix("builtin:")
        if name not in BUILTIN:
            raise ConfigError(setting, f"no built-in suite {suite.path!r}; built in: "
                                       + ", ".join(f"builtin:{b}" for b in BUILTIN))
        items = builtin_arithmetic()
    else:
        path = Path(suite.path).expanduser()
        if not path.is_file():
            raise ConfigError(setting, f"{path}: no such file; prepare the suite's {fmt.upper()} file first (see "
                                       "docs/evaluation.md) or fix the path")
        items = []
        for position, (location, record) in enumerate(_records(path, fmt, setting)):
            if suite.max_items is not None and len(items) >= suite.max_items:
                break
            items.append(_item(suite, where, position, location, record))
    items = items[:suite.max_items] if suite.max_items is not None else items
    if not items:
        raise ConfigError(setting, f"{suite.path} holds no items")
    if suite.choices_field is not None and "{choices}" not in suite.prompt_template:
        raise ConfigError(f"{where}.prompt_template", f"has no {{choices}}: the model would never see the options of "
                                                      f"choices_field {suite.choices_field!r}; put {{choices}} where "
                                                      "the 'A. ...' lines go")
    ids = [item.item_id for item in items]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"{where}.id_field", f"item id {duplicate!r} occurs more than once in {suite.path}; ids "
                                               "seed each item's samples, so they must be unique")
    return items


def _item(suite: EvalSuiteConfig, where: str, position: int, location: str, record: dict[str, Any]) -> QAItem:
    question = _field(record, suite.question_field, f"{where}.question_field", location)
    answer = _field(record, suite.answer_field, f"{where}.answer_field", location)
    choices: Sequence[Any] = ()
    if suite.choices_field is not None:
        choices = _field(record, suite.choices_field, f"{where}.choices_field", location)
        if not isinstance(choices, (list, tuple)) or not 2 <= len(choices) <= len(_LETTERS):
            raise ConfigError(f"{where}.choices_field", f"{location}: {suite.choices_field!r} must be a list of 2 to "
                                                        f"{len(_LETTERS)} options, got {choices!r}"[:400])
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"{where}.question_field", f"{location}: {suite.question_field!r} must be non-empty text, "
                                                     f"got {question!r}"[:400])
    if suite.scorer == "code":  # the reference is the item's test cases, kept as JSON text
        answer = json.dumps(parse_tests(answer, f"{where}.answer_field", location))
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise ConfigError(f"{where}.answer_field", f"{location}: {suite.answer_field!r} must be text or a number, "
                                                   f"got {answer!r}"[:400])
    if suite.scorer == "choice":  # a reference no letter can equal would score every reply 0, silently
        letter = reference_letter(str(answer))
        if len(letter) != 1 or letter not in _LETTERS:
            raise ConfigError(f"{where}.answer_field", f"{location}: {str(answer)!r} is no option letter (A-J); the "
                                                       "choice scorer compares letters: store the right option's "
                                                       "letter (docs/evaluation.md)"[:400])
        if choices and _LETTERS.index(letter) >= len(choices):
            raise ConfigError(f"{where}.answer_field", f"{location}: the answer is {letter}, but the item has "
                                                       f"{len(choices)} options")
    item_id: Optional[Any] = str(position) if suite.id_field is None else \
        _field(record, suite.id_field, f"{where}.id_field", location)
    return QAItem(str(item_id), question, str(answer), tuple(str(c) for c in choices))


def prompt_text(suite: EvalSuiteConfig, item: QAItem) -> str:
    """The user message: ``prompt_template`` with ``{question}`` and ``{choices}`` ("A. ..." lines) replaced."""
    choices = "\n".join(f"{_LETTERS[i]}. {option}" for i, option in enumerate(item.choices))
    return suite.prompt_template.replace("{question}", item.question).replace("{choices}", choices)
