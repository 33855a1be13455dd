"""Typed stage configs <-> argparse flags <-> TOML/YAML files, from one field table.

Each config is a dataclass whose fields carry ``metadata={"help": ..., "flag": ...}``.
The CLI, the ``torchrun`` relaunch and ``torchship run --config`` all derive from it, so
a flag cannot exist in one place and be missing in another.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError


def opt(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    cli: bool = True,
    append: bool = False,
    metavar: str | None = None,
    **kw: Any,
) -> Any:
    """A config field with its help text (say the unit) and, optionally, its flag name and the name its
    value is shown by in --help; ``append``: a sequence given as one value per flag (``--flag=A --flag=B``),
    for values that may start with '-'."""
    md = {"help": help, "flag": flag, "cli": cli, "append": append, "metavar": metavar}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):  # mutable: a fresh copy per instance
        return dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d), metadata=md, **kw)
    return dataclasses.field(default=default, metadata=md, **kw)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    """Add one flag per field of ``cls`` (skipping ``exclude``), showing each default in --help."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.metadata.get("cli", True):
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "help": f.metadata.get("help", "") + " (default: %(default)s)",
            "default": argparse.SUPPRESS,
        }
        origin = typing.get_origin(tp)
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
            kwargs["type"] = type(typing.get_args(tp)[0])
        elif origin in (tuple, list) and f.metadata.get("append"):
            kwargs["action"] = "append"
        elif origin in (tuple, list):
            inner = typing.get_args(tp)[0]
            kwargs["nargs"] = "+"
            kwargs["type"] = inner
        elif tp in (int, float, str):
            kwargs["type"] = tp
        else:
            kwargs["type"] = str
        # show the real default in --help while leaving unset flags out of the namespace
        shown = "none" if default in ((), [], None) else default
        kwargs["help"] = kwargs["help"].replace(
            " (default: %(default)s)", "" if "(default" in kwargs["help"][:-24] else f" (default: {shown})"
        )
        if "metavar" not in kwargs and tp not in (bool,) and origin is not Literal:
            kwargs["metavar"] = f.metadata.get("metavar") or f.name.upper()
        parser.add_argument(flag_name(f), **kwargs)


def namespace_overrides(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that the user actually set on the command line."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}


def build(cls: type, *layers: dict[str, Any], section: str | None = None) -> Any:
    """Build ``cls`` from dict layers (later layers win), converting and checking types.

    Unknown keys raise ConfigError naming them, so a typo in a config file is not ignored; with
    ``section`` (a config file's table, as torchship run reads it) the error names that, not the class.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for layer in layers:
        for key, value in (layer or {}).items():
            key = key.replace("-", "_")
            if key not in fields:
                where = f"in [{section}]" if section else f"for {cls.__name__}"
                raise ConfigError(f"unknown option '{key}' {where}; known: {', '.join(sorted(fields))}")
            values[key] = _coerce(value, hints[key], flag_name(fields[key]), fields[key].metadata.get("append", False))
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{cls.__name__}: {e}") from None


def _coerce(value: Any, tp: Any, flag: str, append: bool = False) -> Any:
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{flag} may not be empty")
    if dataclasses.is_dataclass(inner):  # a nested stage config, given as its own table
        if isinstance(value, inner):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{flag} must be a table of {inner.__name__} options")
        return build(inner, value)
    origin = typing.get_origin(inner)
    try:
        if inner is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if origin is Literal:
            choices = typing.get_args(inner)
            if value not in choices:
                raise ConfigError(f"{flag} must be one of {', '.join(map(str, choices))}, got {value!r}")
            return value
        if origin in (tuple, list):
            elem = typing.get_args(inner)[0]
            if isinstance(value, str):
                value = [value] if append else [v for v in value.replace(",", " ").split() if v]
            seq = [elem(v) for v in value]
            return tuple(seq) if origin is tuple else seq
        if inner in (int, float, str):
            if inner is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return inner(value)
        if origin is dict or inner is dict:
            return dict(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{flag}: cannot read {value!r} as {getattr(inner, '__name__', inner)}") from None
    return value


def to_argv(cfg: Any, exclude: tuple[str, ...] = ()) -> list[str]:
    """Flags that rebuild ``cfg`` when parsed again (used to relaunch under torchrun)."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.name in exclude or not f.metadata.get("cli", True):
            continue
        value = getattr(cfg, f.name)
        if value is None:
            continue
        flag = flag_name(f)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)) and f.metadata.get("append"):
            argv += [f"{flag}={v}" for v in value]
        elif isinstance(value, (list, tuple)):
            if value:
                argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or YAML file into a dict of per-stage sections."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".toml", ".tml"):
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"--config: {path} must end in .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as e:  # parse errors from either library
        raise ConfigError(f"--config: cannot parse {path}: {' '.join(str(e).split())}") from None  # one line
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a table of stage sections")
    return data


def as_dict(cfg: Any) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
