"""Typed configuration from YAML files and `key=value` overrides.

Any frozen dataclass tree can be loaded: a YAML file may name a `base:` file
(relative to itself) whose values it overrides; command-line overrides use
dotted keys (`train.steps=100`) with YAML-typed values. Every value is checked
against the field's type, and each dataclass validates its own ranges, so that
a bad key or value fails with one line naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from epgrpo_jax.io import paths
from epgrpo_jax.io.errors import UserError



class ConfigError(UserError):
  """A configuration problem, stated in one line that names the key."""


class _UniqueKeyLoader(yaml.SafeLoader):
  """YAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps
  the last silently)."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if key in seen:
        raise ConfigError(f"{self.name}: key {key!r} given twice (line {key_node.start_mark.line + 1})")
      seen.add(key)
    return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path, *, flag: str = "--config", default_base: str | None = None,
              _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
  """Reads a YAML config, merging it over its `base:` chain (a file name relative to it).

  `default_base`: a base file of that name that does not exist counts as empty (the built-in
  defaults equal it).
  """
  path = Path(paths.expand_home(str(path)))
  if not path.is_file():
    raise ConfigError(f"{flag}: file not found: {path}")
  try:
    text = path.read_text(encoding="utf-8")
  except UnicodeDecodeError:
    raise ConfigError(f"{path}: not UTF-8 text") from None
  try:
    data = yaml.load(text, Loader=_loader(path))
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1})" if mark else ""
    raise ConfigError(f"{path}: invalid YAML{where}") from None
  data = {} if data is None else data
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: top level must be a mapping of sections")
  base = data.pop("base", None)
  if base is None:
    return data
  if not isinstance(base, str) or not base.strip():
    raise ConfigError(f"{path}: base: must be a file name, got {base!r}")
  base_path = path.parent / paths.expand_home(base)
  chain = (*_chain, path.resolve())
  if base_path.resolve() in chain:
    loop = " -> ".join(p.name for p in (*chain, base_path.resolve()))
    raise ConfigError(f"{path}: base: {base} makes a loop ({loop})")
  if default_base is not None and base == default_base and not base_path.is_file():
    return data
  return deep_merge(load_yaml(base_path, flag=flag, default_base=default_base,
                              _chain=chain), data)


def _loader(path: Path):
  def make(stream):
    loader = _UniqueKeyLoader(stream)
    loader.name = str(path)
    return loader
  return make


def deep_merge(base: dict, over: dict) -> dict:
  out = dict(base)
  for k, v in over.items():
    out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


class Override:
  """A command-line value: YAML-typed, but kept as typed text for string fields.

  (`data.prompt_template={problem}` is a YAML mapping, but the field wants the text.)
  """

  def __init__(self, raw: str, parsed: Any):
    self.raw, self.parsed = raw, parsed

  def for_type(self, tp) -> Any:
    if tp is str and not isinstance(self.parsed, str):
      return self.raw
    return self.parsed

  def __repr__(self):
    return repr(self.parsed)


def parse_overrides(items: list[str]) -> dict[str, Any]:
  """['train.steps=10', 'lora.targets=[q,v]'] -> nested dict with YAML-typed values."""
  out: dict[str, Any] = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
      raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=100")
    try:
      value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
      value = raw
    node = out
    *parents, leaf = key.split(".")
    for p in parents:
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ConfigError(f"override {item!r}: {p!r} is set both as a value and a section")
    node[leaf] = Override(raw, value)
  return out


def _type_name(tp) -> str:
  return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def coerce(tp, value: Any, key: str):
  """Checks `value` against the annotation `tp`, converting lists to tuples and ints to floats;
  `~` in a `UserPath` becomes the home directory."""
  if paths.is_user_path(tp):
    text = coerce(typing.get_args(tp)[0], value, key)
    try:
      return paths.expand_home(text)
    except UserError as e:
      raise ConfigError(f"{key}: {e}") from None
  if isinstance(value, Override):
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    value = value.for_type(str if str in options or tp is str else tp)
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(tp)
    if value is None and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return coerce(option, value, key)
      except ConfigError as e:
        errors.append(e)
    raise errors[0] if len(errors) == 1 else ConfigError(
        f"{key}: expected {' or '.join(_type_name(o) for o in options)}, got {value!r}")
  if origin is typing.Literal:
    if value not in typing.get_args(tp):
      raise ConfigError(f"{key}: must be one of {list(typing.get_args(tp))}, got {value!r}")
    return value
  if origin in (tuple, list):
    args = typing.get_args(tp)
    if isinstance(value, str):
      value = [v.strip() for v in value.split(",") if v.strip()] if value else []
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}: expected a list, got {value!r}")
    item_tp = args[0] if args else Any
    return tuple(coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if not isinstance(value, dict):
      raise ConfigError(f"{key}: expected a section (mapping), got {value!r}")
    return build(tp, value, prefix=key + ".")
  if tp is Any:
    return value
  if tp is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{key}: expected true or false, got {value!r}")
  if tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      if not -2 ** 63 <= value < 2 ** 63:
        raise ConfigError(f"{key}: out of the 64-bit integer range, got {value!r}")
      return value
    raise ConfigError(f"{key}: expected an integer, got {value!r}")
  if tp is float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      number = float(value)
    elif isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
      try:
        number = float(value)
      except ValueError:
        pass
    if number is None:
      raise ConfigError(f"{key}: expected a number, got {value!r}")
    if not math.isfinite(number):
      raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return number
  if tp is str:
    if isinstance(value, str):
      return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return str(value)
    raise ConfigError(f"{key}: expected a string, got {value!r}")
  if isinstance(tp, type) and isinstance(value, tp):
    return value
  raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def build(cls, data: dict[str, Any], prefix: str = ""):
  """Instantiates dataclass `cls` from a nested dict, naming any bad key."""
  if not isinstance(data, dict):
    raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  hints = typing.get_type_hints(cls, include_extras=True)
  kwargs = {}
  for key, value in data.items():
    if key not in fields:
      close = difflib.get_close_matches(str(key), list(fields), n=1)
      hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
      raise ConfigError(f"{prefix}{key}: unknown key{hint}")
    default = fields[key].default
    if isinstance(value, dict) and dataclasses.is_dataclass(default):
      # A partial section starts from the parent's default for it, not the section class's.
      value = deep_merge(to_dict(default), value)
    kwargs[key] = coerce(hints[key], value, prefix + key)
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    if prefix and not message.startswith(prefix.rstrip(".").split(".")[0]):
      message = f"{prefix.rstrip('.')}: {message}"
    raise ConfigError(message) from None


def to_dict(obj) -> Any:
  """A dataclass tree as plain YAML-able data."""
  if dataclasses.is_dataclass(obj):
    return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
  if isinstance(obj, tuple):
    return [to_dict(v) for v in obj]
  return obj


def load(cls, config_file: str | Path | None = None, overrides: list[str] = (),
         defaults_file: str | Path | None = None):
  """`cls` from an optional YAML file (or `defaults_file`) plus dotted overrides."""
  data: dict[str, Any] = {}
  if config_file is not None:
    data = load_yaml(config_file)
  elif defaults_file is not None:
    data = load_yaml(defaults_file)
  data = deep_merge(data, parse_overrides(list(overrides)))
  return build(cls, data)
