"""The metrics record format: one JSON object per line of ``metrics.jsonl``, written and read back.

A record is ``{"step": int, "time": unix seconds, "<group>/<name>": number, ...}``. Metric names always carry a group
prefix (``agent/return``, ``gpu/0/power_w``), so they never collide with ``step`` and ``time`` and the report can
group them. Non-finite values are written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (strict JSON
has no literal for them; ``null`` would lose which one it was) and read back as floats.

Reading never fails on a bad line: a line cut short by a crash, or one edited by hand, comes back as a :class:`Line`
with its problem and line number, and the reader goes on.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from spade_mega.errors import SpadeError

METRICS_FILE = "metrics.jsonl"
STEP, TIME = "step", "time"
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# group/name with at least one slash; no spaces, so names stay valid TensorBoard tags and file names
_NAME = re.compile(r"[A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+")


class MetricError(SpadeError, ValueError):
    """A metric with a bad name or value: the message names the metric."""


def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise MetricError(f"metric name {name!r}: must look like group/name (letters, digits, '_', '.', '-' "
                          "separated by '/', e.g. agent/return or gpu/0/power_w)")
    return name


def to_number(name: str, value: object) -> float | int:
    """``value`` as a Python int or float: numbers, numpy scalars and one-element tensors/arrays (``.item()``)."""
    raw = value
    if not isinstance(value, numbers.Number) and hasattr(value, "item") and hasattr(value, "shape"):
        size = math.prod(value.shape)  # type: ignore[union-attr]
        if size != 1:
            raise MetricError(f"metric {name!r}: expected a scalar, got a tensor/array of shape "
                              f"{tuple(value.shape)}; reduce it first (mean, sum)")  # type: ignore[union-attr]
        value = value.item()  # type: ignore[union-attr]
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        try:
            float(value)  # every reader (TensorBoard, the report, a resume) takes it as a float
        except OverflowError:
            raise MetricError(f"metric {name!r}: an integer of {int(value).bit_length()} bits is too large for "
                              "a float; log it as a float (inf) or scaled down") from None
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise MetricError(f"metric {name!r}: expected a number (int, float or a scalar tensor), "
                      f"got {type(raw).__name__} {raw!r:.60}")


def _encode(value: float | int) -> float | int | str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def encode_record(step: int, time: float, metrics: Mapping[str, float | int]) -> str:
    """One line of ``metrics.jsonl`` (without the newline); strict JSON, non-finite values as strings."""
    return json.dumps({STEP: step, TIME: round(time, 3), **{k: _encode(v) for k, v in metrics.items()}},
                      allow_nan=False, separators=(",", ":"))


@dataclass(frozen=True)
class Record:
    step: int
    time: float
    metrics: dict[str, float]


@dataclass
class Line:
    """One line of a metrics file: its 1-based number, its bytes (kept verbatim), the record it holds if it
    parsed, and what was wrong with it."""

    number: int
    raw: bytes
    record: Optional[Record] = None
    problems: list[str] = field(default_factory=list)


def _decode_value(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)  # an int too large for a float raises OverflowError: parse_line says so
    if value is None:
        return math.nan
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    return None


def parse_line(number: int, raw: bytes) -> Line:
    line = Line(number, raw)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        line.problems.append("not UTF-8 text")
        return line
    except json.JSONDecodeError as exc:
        line.problems.append(f"not valid JSON ({exc.msg} at column {exc.colno}; a record cut short by a crash?)")
        return line
    except RecursionError:
        line.problems.append("not a record (JSON nested too deeply to read)")
        return line
    except ValueError as exc:  # an integer literal past Python's digit limit
        line.problems.append(f"not a record ({exc})")
        return line
    if not isinstance(data, dict):
        line.problems.append(f"not a JSON object (got {type(data).__name__})")
        return line
    step, time = data.pop(STEP, None), data.pop(TIME, None)
    if type(step) is not int or step < 0:
        line.problems.append(f"no non-negative integer 'step' (got {step!r})")
        return line
    metrics = {}
    for name, value in data.items():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: no page or plot can show it
            line.problems.append(f"metric name {name!r} is not valid text; value skipped")
            continue
        try:
            number_ = _decode_value(value)
        except OverflowError:
            line.problems.append(f"metric {name!r} is too large for a float ({value.bit_length()} bits); value skipped")
            continue
        if number_ is None:
            line.problems.append(f"metric {name!r} is not a number (got {value!r:.40}); value skipped")
        else:
            metrics[name] = number_
    try:
        wall = float(time) if isinstance(time, (int, float)) and not isinstance(time, bool) else math.nan
    except OverflowError:
        wall = math.nan
    line.record = Record(step, wall, metrics)
    return line


def scan(path: str | Path) -> list[Line]:
    """Every non-blank line of a metrics file, parsed; bad lines are kept with their problems, never raised."""
    data = Path(path).read_bytes()
    return [parse_line(i, raw) for i, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
