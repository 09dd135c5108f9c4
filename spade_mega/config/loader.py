"""YAML loading with ``base:`` inheritance, dotted command-line overrides, and typed conversion into the schema.

Resolution order: the ``base:`` chain (each base resolved relative to the file naming it, nearest file wins), then
overrides in the order given. Mappings merge key by key; any other value (lists included) replaces what it overrides.
Conversion checks every value against the schema's annotations and reports the first problem as a
:class:`ConfigError` naming the full dotted key and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union

import yaml

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import SpadeConfig

T = TypeVar("T")
BASE_KEY = "base"
RESOLVED_NAME = "config.yaml"
# Keys a release removed, with what replaced them: an old config gets this instead of a guess at a similar name.
REMOVED_KEYS = {
    "rewards.solve_threshold": "replaced by rewards.win_threshold, which decides every win rate (the plateau, the "
                               "learning-potential EMAs, micro learning potential, the memory's outcomes, the "
                               "solvability check, metrics), not learnability's solve rate alone; rename it after "
                               "checking the value is the reward a program pays for solving its task "
                               "(docs/environments.md, 'What counts as a win')",
}


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(str(path), "config file not found" if not path.exists() else "not a regular file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(str(path), f"invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"top level must be a mapping of sections, got {type(data).__name__}")
    return data


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``top`` over ``base``: nested mappings merge, everything else in ``top`` replaces."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_raw(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML file and everything it inherits through ``base:`` into one plain dict."""
    path = Path(path).expanduser().resolve()
    if path in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, path))
        raise ConfigError(str(path), f"'base:' inheritance forms a cycle: {cycle}")
    data = _read_yaml(path)
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: {BASE_KEY}", "must be a file path or a list of file paths")
    merged: dict[str, Any] = {}
    for base in bases:
        merged = deep_merge(merged, load_raw(path.parent / base, (*_chain, path)))
    return deep_merge(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and a YAML-parsed value (so lists and mappings work)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(text, "an override must look like section.key=value")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(key, "empty component in dotted key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the literal text, the schema decides whether a string is acceptable
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply dotted overrides to a raw config dict (returns a new dict)."""
    for text in overrides:
        parts, value = parse_override(text)
        patch: Any = value
        for part in reversed(parts):
            patch = {part: patch}
        data = deep_merge(data, patch)
    return data


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of str to {_type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    return f"got {type(value).__name__} {value!r}" if not isinstance(value, Mapping) else "got a mapping"


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to annotation ``tp`` or raise a ConfigError naming ``path`` and the expected type."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected {_type_name(tp)}, {_got(value)}")
        return build(tp, value, path)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(path, f"expected {_type_name(tp)}, {_got(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if not any(value == c and type(value) is type(c) for c in choices):
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(path, f"expected {_type_name(tp)}, {_got(value)}{suggestion}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected {_type_name(tp)}, {_got(value)}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected {_type_name(tp)}, {_got(value)}")
        _, item = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{path}.{k}", f"keys must be strings, got {type(k).__name__}")
            out[k] = _convert(v, item, f"{path}.{k}")
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected bool (true/false), {_got(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected int, {_got(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string; accept numeric text
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(path, f"expected float, {_got(value)}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected float, {_got(value)}")
        if not math.isfinite(value):
            raise ConfigError(path, f"expected a finite float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected str, {_got(value)}")
        return value
    raise TypeError(f"schema annotation {tp!r} at {path} is not supported by the config loader")


def build(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys with a did-you-mean suggestion."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names and full in REMOVED_KEYS:
            raise ConfigError(full, f"removed: {REMOVED_KEYS[full]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            suggestion = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(full, f"unknown key{suggestion}")
        kwargs[key] = _convert(value, hints[key], full)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a config (dataclasses.asdict), ready for YAML or JSON."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> SpadeConfig:
    """Resolve a config file (or the defaults, when ``path`` is None) plus overrides, convert and check it."""
    data = load_raw(path) if path is not None else {}
    data = apply_overrides(data, overrides)
    cfg = build(SpadeConfig, data)
    cfg.check()
    return cfg


def save_resolved(cfg: SpadeConfig, run_dir: str | Path) -> Path:
    """Write the resolved config into a run directory (atomically), so every run records what it ran with."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_NAME
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    tmp.replace(target)
    return target


def prepare_run_dir(cfg: SpadeConfig) -> Path:
    """Create ``run.output_dir/run.name`` and save the resolved config into it."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    save_resolved(cfg, run_dir)
    return run_dir
