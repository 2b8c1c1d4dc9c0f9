"""The node configuration: defaults < TOML file < environment < flags, each
setting declared once in the core's table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from slipstream import ConfigError, _core
from slipstream._internal import cli, config


def parse(*args: str) -> object:
    return cli.build_parser().parse_args(["serve", "app.py", *args])


def test_every_setting_has_a_flag_env_and_help() -> None:
    table = config.settings()
    names = {s.name for s in table}
    assert {"host", "port", "grpc_port", "request_timeout_s", "batching", "autoscale"} <= names
    parser = cli.build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
                 if a.prog.endswith(" serve"))
    flags = set(serve._option_string_actions)
    for s in table:
        assert s.flag in flags, s.name
        assert s.help and s.env == "SLIPSTREAM_" + s.name.upper()
    # The core's own defaults, with nothing given.
    cfg = config.resolve({}, environ={})
    assert cfg["port"] is None and cfg["request_timeout_s"] == 30.0 and cfg["admission"] is True
    assert set(cfg.sources.values()) == {"default"}


def test_layers_in_order(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('port = 9100\nrequest_timeout_s = 12\nbatching = "fixed"\nadmin_token = "from-file"\n')
    env = {"SLIPSTREAM_REQUEST_TIMEOUT_S": "7.5", "SLIPSTREAM_ADMISSION": "false"}
    cfg = config.resolve(parse("--config", str(f), "--batching", "deadline"), environ=env)
    assert cfg["port"] == 9100 and cfg.sources["port"] == f"file {f}"
    assert cfg["request_timeout_s"] == 7.5 and cfg.sources["request_timeout_s"] == "env SLIPSTREAM_REQUEST_TIMEOUT_S"
    assert cfg["admission"] is False
    assert cfg["batching"] == "deadline" and cfg.sources["batching"] == "flag --batching"
    assert cfg["admin_token"] == "from-file"
    # The file may also be named by $SLIPSTREAM_CONFIG.
    cfg = config.resolve(parse(), environ={"SLIPSTREAM_CONFIG": str(f)})
    assert cfg["port"] == 9100
    # Spec settings go into the spec; node settings to the core.
    sections = cfg.spec_sections()
    assert sections["batching"]["policy"] == "fixed" and "cores" not in sections["autoscale"]
    node = json.loads(cfg.node_json())
    assert node["port"] == 9100 and "batching" not in node


def test_bad_values_are_refused_clearly(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'prot' \(did you mean port\?\)"):
        config.resolve(parse("--config", str(f)), environ={})
    f.write_text('port = "eighty"\n')
    with pytest.raises(ConfigError, match="port must be an integer"):
        config.resolve(parse("--config", str(f)), environ={})
    f.write_text("port = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.resolve(parse("--config", str(f)), environ={})
    with pytest.raises(ConfigError, match="no configuration file"):
        config.resolve(parse("--config", str(tmp_path / "missing.toml")), environ={})
    with pytest.raises(ConfigError, match="SLIPSTREAM_ADMISSION: admission must be true or false"):
        config.resolve(parse(), environ={"SLIPSTREAM_ADMISSION": "maybe"})
    with pytest.raises(ConfigError, match="autoscale must be one of"):
        config.resolve(parse(), environ={"SLIPSTREAM_AUTOSCALE": "sometimes"})
    # Range checks are the core's, once.
    with pytest.raises(ConfigError, match="request_timeout_s must be a positive number"):
        config.resolve(parse("--request-timeout", "0"), environ={})
    with pytest.raises(_core.CoreError):
        _core.check_config('{"pool_mb": 0}')
    # Options from Python (ss.launch) are checked against the table too.
    with pytest.raises(ConfigError, match="unknown setting 'timeout'"):
        config.resolve({"timeout": 3}, environ={})


def test_config_command_prints_values_and_sources(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text("max_body_mb = 8\n")
    # SLIPSTREAM_THREADS is a worker's thread budget, not a node setting.
    env = {"SLIPSTREAM_PORT": "9200", "SLIPSTREAM_THREADS": "7", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "config", "--config", str(f),
                          "--threads", "3", "--json"], capture_output=True, text=True, env=env, check=True).stdout
    got = json.loads(out)
    assert got["max_body_mb"] == {"value": 8.0, "source": f"file {f}"}
    assert got["port"] == {"value": 9200, "source": "env SLIPSTREAM_PORT"}
    assert got["node_threads"] == {"value": 3, "source": "flag --threads"}
    assert got["host"]["source"] == "default"
    text = subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "config"], capture_output=True,
                          text=True, env=env, check=True).stdout
    assert any(line.split()[:2] == ["port", "9200"] and line.endswith("env SLIPSTREAM_PORT")
               for line in text.splitlines())
    assert any(line.startswith("node_threads") and line.endswith("default") for line in text.splitlines())
    bad = subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "config", "--pool-mb", "0"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "pool_mb must be at least 1" in bad.stderr
