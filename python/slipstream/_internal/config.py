"""The node's configuration: one table of settings, four layers.

Each setting is declared once, in the compiled core
(``crates/slipstream-runtime/src/config.rs``: name, type, default, help).
This module derives the rest from that table and layers the values, each
layer over the one before:

1. the default;
2. a TOML file: ``--config node.toml`` (or ``$SLIPSTREAM_CONFIG``), keys are
   the setting names (``request_timeout_s = 10``);
3. the environment: ``SLIPSTREAM_<NAME>`` (``SLIPSTREAM_REQUEST_TIMEOUT_S=10``);
4. flags: ``--<name-with-dashes>`` (a few keep older spellings, e.g.
   ``--request-timeout``; booleans take ``--admission/--no-admission``).

``slipstream config`` prints the effective values and where each came
from. Values are checked once, by the core, before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from slipstream._internal.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "SLIPSTREAM_"
CONFIG_ENV = "SLIPSTREAM_CONFIG"


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # str, int, float, bool, choice
    optional: bool
    choices: tuple[str, ...]
    default: Any
    help: str
    flag: str
    scope: str  # node or spec

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


@cache
def settings() -> tuple[Setting, ...]:
    from slipstream import _core

    return tuple(
        Setting(name=s["name"], kind=s["kind"], optional=s["optional"], choices=tuple(s["choices"]),
                default=s["default"], help=s["help"], flag=s["flag"] or "--" + s["name"].replace("_", "-"),
                scope=s["scope"])
        for s in json.loads(_core.node_settings())
    )


def _by_name() -> dict[str, Setting]:
    return {s.name: s for s in settings()}


@dataclass
class Config:
    """Effective values and, for each, where it came from."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def node_json(self) -> str:
        """The node settings, for ``_core.serve``."""
        return json.dumps({s.name: self.values[s.name] for s in settings() if s.scope == "node"})

    def spec_sections(self) -> dict[str, Any]:
        """The spec's ``batching`` and ``autoscale`` sections."""
        v = self.values
        return {
            "batching": {"policy": v["batching"], "fixed_wait_ms": v["fixed_wait_ms"],
                         "max_wait_ms": v["max_wait_ms"], "admission": v["admission"],
                         "by_length": v["batch_by_length"]},
            "autoscale": {"policy": v["autoscale"], "down_after_s": v["scale_down_after_s"],
                          **({"cores": v["cores"]} if v["cores"] is not None else {})},
        }


def _convert(s: Setting, value: Any, where: str) -> Any:
    """A value from a file (typed) or the environment (a string), checked against its kind."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{where}: {s.name} {why}")

    if isinstance(value, str) and s.kind != "str" and s.kind != "choice":
        text = value.strip()
        if s.optional and text == "":
            return None
        if s.kind == "bool":
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise bad(f"must be true or false, got {value!r}")
        try:
            return int(text) if s.kind == "int" else float(text)
        except ValueError:
            raise bad(f"must be {'an integer' if s.kind == 'int' else 'a number'}, got {value!r}") from None
    if s.kind == "bool":
        if not isinstance(value, bool):
            raise bad(f"must be true or false, got {value!r}")
        return value
    if s.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"must be an integer, got {value!r}")
        return value
    if s.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise bad(f"must be a string, got {value!r}")
    if s.optional and value == "":
        return None
    if s.kind == "choice" and value not in s.choices:
        raise bad(f"must be one of {', '.join(s.choices)}, got {value!r}")
    return value


def _unknown(name: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(name, [s.name for s in settings()], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"{where}: unknown setting {name!r}{hint}; `slipstream config` lists them")


def read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no configuration file {p}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    by = _by_name()
    out = {}
    for k, v in data.items():
        if k not in by:
            raise _unknown(k, str(p))
        out[k] = _convert(by[k], v, str(p))
    return out


def resolve(flags: Mapping[str, Any] | argparse.Namespace | None = None, *, config_file: str | Path | None = None,
            environ: Mapping[str, str] | None = None, check: bool = True) -> Config:
    """Layer defaults, file, environment and flags. ``flags``: the parsed
    arguments (only those given on the command line are present, see
    :func:`add_flags`) or a mapping of setting names to values (``ss.launch``'s
    options)."""
    env = os.environ if environ is None else environ
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    cfg = Config()
    for s in settings():
        cfg.values[s.name] = s.default
        cfg.sources[s.name] = "default"
    path = config_file or given.get("config") or env.get(CONFIG_ENV) or None
    if path:
        for k, v in read_file(path).items():
            cfg.values[k] = v
            cfg.sources[k] = f"file {path}"
    for s in settings():
        if s.env in env:
            cfg.values[s.name] = _convert(s, env[s.env], f"${s.env}")
            cfg.sources[s.name] = f"env {s.env}"
    by = _by_name()
    for k, v in given.items():
        if k == "config":
            continue
        if k not in by:
            if isinstance(flags, argparse.Namespace):
                continue  # another command's flag
            raise _unknown(k, "options")
        cfg.values[k] = v if isinstance(flags, argparse.Namespace) else _convert(by[k], v, "options")
        cfg.sources[k] = f"flag {by[k].flag}" if isinstance(flags, argparse.Namespace) else "option"
    if check:
        from slipstream import _core

        try:
            _core.check_config(cfg.node_json())
        except _core.CoreError as e:
            raise ConfigError(f"invalid configuration: {e.args[1]}") from None
    return cfg


def add_flags(p: argparse.ArgumentParser, scope: str | None = None) -> None:
    """A flag per setting (of one scope, or all), plus ``--config``. Unset
    flags stay absent from the parsed namespace, so :func:`resolve` can tell
    them from defaults."""
    if "--config" not in p._option_string_actions:
        p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                       help=f"a TOML file of settings (default: ${CONFIG_ENV}); `slipstream config` lists them")
    for s in settings():
        if scope is not None and s.scope != scope:
            continue
        default = "unset" if s.default is None else json.dumps(s.default)
        help_ = f"{s.help} (default: {default}; ${s.env})"
        kw: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": help_}
        if s.kind == "bool":
            p.add_argument(s.flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if s.kind == "choice":
            kw["choices"] = s.choices
        elif s.kind in ("int", "float"):
            kw["type"] = int if s.kind == "int" else float
        p.add_argument(s.flag, metavar=s.name.upper() if s.kind != "choice" else None, **kw)


def cmd_config(a: argparse.Namespace) -> int:
    """``slipstream config``: the effective configuration and where each value came from."""
    cfg = resolve(a)
    if getattr(a, "json", False):
        print(json.dumps({k: {"value": cfg.values[k], "source": cfg.sources[k]} for k in cfg.values}, indent=2))
        return 0
    width = max(len(k) for k in cfg.values)
    for s in settings():
        v = cfg.values[s.name]
        shown = "(unset)" if v is None else ("***" if s.name in ("admin_token", "api_token") else json.dumps(v))
        print(f"{s.name:<{width}}  {shown:<16}  {cfg.sources[s.name]}")
    return 0


def add_command(sub: Any) -> None:
    c = sub.add_parser("config", help="print the effective node configuration and where each value came from",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(c)
    c.add_argument("--json", action="store_true", help="as JSON")
    c.set_defaults(fn=cmd_config)
