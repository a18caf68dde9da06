"""Reading a training config: YAML files (YAML 1.2 booleans) and `a.b=value` overrides into a
validated bapo.train.config.TrainConfig, every error one line naming the field, the value and where
it was set (file and line, or the override); an unknown key fails with the nearest valid name; the
keys renamed since (RENAMED_KEYS: refused in a user's config, read in an old run folder by
upgrade_run_config); `--print-config` (describe_config).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from bapo.train.config import ConfigError, Section, TrainConfig, _suggest


# -- YAML ---------------------------------------------------------------------------------------
class _YamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. YAML 1.1 (PyYAML's default) also turns on/off/yes/no
    into booleans, so `tensorboard: off` would reach a string field as False."""


_BOOL = "tag:yaml.org,2002:bool"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str):
    return yaml.load(text, Loader=_YamlLoader)


def _key_lines(text: str) -> dict[str, int]:
    """dotted key -> 1-based line of that key in a YAML text (for error messages)."""
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = prefix + str(key.value)
                lines[name] = key.start_mark.line + 1
                walk(value, name + ".")

    with contextlib.suppress(yaml.YAMLError):
        walk(yaml.compose(text, Loader=_YamlLoader), "")
    return lines


# -- fields -------------------------------------------------------------------------------------
def _field(parts: list[str]):
    """The pydantic FieldInfo at a dotted path of TrainConfig, or None (unknown / inside a dict)."""
    model, info = TrainConfig, None
    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = info.annotation
    return info


def _accepts_str(annotation) -> bool:
    if annotation is str:
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    if origin is Union or origin is UnionType:
        return any(_accepts_str(a) for a in get_args(annotation))
    return False


_NULLS = ("", "null", "Null", "NULL", "~")


def _quoted(text: str) -> bool:
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


def apply_override(data: dict, item: str) -> None:
    """`a.b=value` into the nested dict. The value is parsed as YAML 1.2 (numbers, true/false,
    lists, null), except that a field which accepts a string takes the text as written (unless
    quoted or null): `run.tensorboard=off` stays "off", `data.system_prompt=Answer: 42` stays
    that sentence."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. loss.method=bapo)")
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    text, info = raw.strip(), _field(parts)
    if info is not None and _accepts_str(info.annotation) and text not in _NULLS and not _quoted(text):
        value = raw  # verbatim: YAML would turn off/yes into booleans, `a: b` into a mapping, `>` into ""
    else:
        try:
            value = parse_yaml(text) if text else None
        except yaml.YAMLError:
            value = text
    node[parts[-1]] = value


# -- loading ------------------------------------------------------------------------------------
class _Origin:
    """Where each key came from: a line of the config file, or a command-line override."""

    def __init__(self, source: str | None, lines: dict[str, int], overridden: set[str]):
        self.source, self.lines, self.overridden = source, lines, overridden

    def where(self, key: str) -> str:
        if key in self.overridden:
            return " [command-line override]"
        if self.source is None:
            return ""
        probe = key
        while probe:
            if probe in self.lines:
                return f" [{self.source} line {self.lines[probe]}]"
            probe = probe.rpartition(".")[0]
        return f" [{self.source}]"


def _error_line(msg: str, where: str, origin: _Origin, value=None) -> str:
    """One message: field, problem, the value given, where it was set."""
    if where in ("model", "model.path") and (msg == "Field required" or value is None):
        at = origin.where("model.path") if value is None else (f" in {origin.source}" if origin.source else "")
        return (
            "model.path is not set"
            + at
            + ": give a local model folder or a Hugging Face id (model.path=DIR on the command line, "
            "or `model: {path: DIR}` in the config file)"
        )
    if where == "config":  # a whole-config check: its message starts with the field it is about
        match = re.match(r"([a-z_]+(?:\.[a-z_]+)+)", msg)
        return msg + (origin.where(match.group(1)) if match else "")
    got = f" (got {value!r})" if value is not None and not isinstance(value, dict) else ""
    text = msg if msg.startswith(where) else f"{where}: {msg}{got}"
    return text + origin.where(where)


#: old dotted key -> its new name; an old key fails with one line naming the new one
RENAMED_KEYS = {"run.steps": "run.rollout_steps", "offpolicy.staleness": "offpolicy.async_delay"}
#: why a renamed key is not read under its new name: the old one meant something else to a reader
RENAME_NOTES = {
    "offpolicy.staleness": "it was the async delay k; the paper's staleness E is "
    "offpolicy.mini_batches x offpolicy.epochs - 1",
}
#: dotted key added later -> the value every run written before it ran with: a resume of such a
#: run (whose config.yaml lacks the key) continues with that value, not today's default
ADDED_KEYS = {"offpolicy.minibatch_split": "rows"}


def upgrade_run_config(data: dict) -> dict:
    """A config a run wrote for itself (its config.yaml, nested dicts) in today's keys, in place: the
    one place old run folders' keys are read. Every key renamed since (RENAMED_KEYS) moves to its new
    name, exact because the old name meant what the new one means when that run was written (a config
    a user writes is refused instead: _check_keys); every key added since (ADDED_KEYS) gets the value
    that run ran with, so a resume continues it as it was."""
    for old, new in RENAMED_KEYS.items():
        *old_sections, old_leaf = old.split(".")
        node = data
        for part in old_sections:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and old_leaf in node:
            _nested_setdefault(data, new, node.pop(old_leaf))
    for key, value in ADDED_KEYS.items():
        _nested_setdefault(data, key, value)
    return data


def _nested_setdefault(data: dict, dotted: str, value) -> None:
    *sections, leaf = dotted.split(".")
    for part in sections:
        data = data.setdefault(part, {})
    data.setdefault(leaf, value)


def _check_keys(data: dict, model: type[BaseModel], origin: _Origin, prefix: str = "") -> None:
    """Unknown keys fail with the nearest valid dotted name (before pydantic's own message)."""
    for key, value in data.items():
        fields = model.model_fields
        if prefix + key in RENAMED_KEYS:
            note = f" ({RENAME_NOTES[prefix + key]})" if prefix + key in RENAME_NOTES else ""
            raise ConfigError(
                f"{prefix + key} was renamed {RENAMED_KEYS[prefix + key]}{origin.where(prefix + key)}: "
                f"write {RENAMED_KEYS[prefix + key]} instead{note}"
            )
        if key not in fields:
            options = [prefix + name for name in fields]
            raise ConfigError(
                f"unknown config key {prefix + key!r}"
                + _suggest(prefix + key, options)
                + origin.where(prefix + key)
                + f"; valid keys here: {', '.join(options)}"
            )
        sub = fields[key].annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, Section):
            _check_keys(value, sub, origin, prefix + key + ".")


def config_from_dict(
    data: dict, overrides: list[str] = (), *, source: str | None = None, lines: dict[str, int] | None = None
) -> TrainConfig:
    """A validated TrainConfig from nested dicts + `a.b=value` overrides. Errors are one line
    each, naming the field, the value, and where it was set (file and line, or the override)."""
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy with plain types
    for item in overrides:
        apply_override(data, item)
    origin = _Origin(source, lines or {}, {item.partition("=")[0].strip() for item in overrides})
    _check_keys(data, TrainConfig, origin)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        messages = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "config"
            messages.append(_error_line(e["msg"].removeprefix("Value error, "), where, origin, e.get("input")))
        raise ConfigError("; ".join(messages)) from None


def read_config_file(path: str | Path) -> tuple[dict, dict[str, int]]:
    """A YAML config file -> (its nested dict, dotted key -> 1-based line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file {path} not found: give an existing YAML file, or only key=value "
            "overrides (e.g. bapo train model.path=DIR data.path=train.jsonl)"
        )
    text = path.read_text()
    try:
        data = parse_yaml(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"{path}{at}: not valid YAML ({getattr(err, 'problem', None) or err}); fix the indentation or quoting there"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
    return data, _key_lines(text)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (or None for an empty base) + `a.b=value` overrides -> a validated TrainConfig."""
    if path is None:
        return config_from_dict({}, overrides)
    data, lines = read_config_file(path)
    return config_from_dict(data, overrides, source=str(path), lines=lines)


def load_run_config(run_dir: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """RUN_DIR/config.yaml (the config a run saved, read through upgrade_run_config) + overrides."""
    path = Path(run_dir) / "config.yaml"
    data, lines = read_config_file(path)
    return config_from_dict(upgrade_run_config(data), overrides, source=str(path), lines=lines)


# -- --print-config ----------------------------------------------------------------------------
def describe_config(path: str | Path | None = None, overrides: list[str] = ()) -> str:
    """The full resolved config as YAML, every key with its description and default.

    A missing model.path is shown as null (so the command works before one is chosen); every
    other problem raises the usual ConfigError.
    """
    data, lines = read_config_file(path) if path is not None else ({}, {})
    merged = yaml.safe_load(yaml.safe_dump(data))
    for item in overrides:
        apply_override(merged, item)
    placeholder = not (merged.get("model") or {}).get("path")
    if placeholder:
        merged.setdefault("model", {})
        merged["model"] = dict(merged["model"] or {}, path="<unset>")
    cfg = config_from_dict(merged, source=str(path) if path else None, lines=lines)
    values = cfg.model_dump(mode="json")
    if placeholder:
        values["model"]["path"] = None
    out: list[str] = []

    def render(model: type[BaseModel], values: dict, indent: str) -> None:
        for name, info in model.model_fields.items():
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out.append(f"{indent}{name}:" + (f"  # {info.description}" if info.description else ""))
                render(sub, values[name], indent + "  ")
                continue
            value = yaml.safe_dump(values[name], default_flow_style=True, width=10_000).strip()
            value = value.removesuffix("\n...").strip()
            default = (
                "required"
                if info.is_required()
                else "default "
                + yaml.safe_dump(info.get_default(call_default_factory=True), default_flow_style=True, width=10_000)
                .strip()
                .removesuffix("\n...")
                .strip()
            )
            out.append(f"{indent}{name}: {value}  # {info.description or ''} ({default})")

    render(TrainConfig, values, "")
    return "\n".join(out) + "\n"
