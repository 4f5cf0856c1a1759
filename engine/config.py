"""``agentloop.toml``: the one reader of the file, every section checked before any is used.

The file may name the models (``default``, ``[models.ALIAS]``: ``engine.models``), the
workers' Python (``python``: ``engine.sandbox``) and the hosts they may reach (``[network]``
``allow = ["HOST[:PORT]", ...]``: ``engine.net``, each entry as ``--allow-net`` takes it); any other key is a mistake (``pyhton = ...``),
refused rather than ignored.  A command that reads the file for one part of it refuses the same
mistakes in the same words as one that reads another part, and the file is read only once no
worker could have written it (``engine.trust``).
"""

from __future__ import annotations

import math
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from engine import trust
from engine.errors import ConfigError

__all__ = ["CONFIG_FILE", "MODEL_KEYS", "PROTOCOLS", "TOP_KEYS", "read_config"]

CONFIG_FILE = "agentloop.toml"
#: What the file may hold at its top.
TOP_KEYS = ("default", "models", "python", "network")
#: What a ``[models.ALIAS]`` section may hold (``engine.models.ModelConfig``'s fields but the alias).
MODEL_KEYS = ("base_url", "model", "api_key_env", "context_window", "price_in", "price_out", "protocol",
              "timeout", "max_tokens", "vision")
#: How a model may be spoken to: ``<run_code>`` tags, or native tool calls.
PROTOCOLS = ("tags", "tools")


def read_config(path: str | Path) -> dict[str, Any]:
    """``path`` (an agentloop.toml) read and checked whole: ConfigError naming the file and what
    to fix, or UntrustedFile (one line: why, and what to do) when a worker could have written it,
    whatever keys it holds.  What it returns has passed every check: its readers only apply it."""
    path = Path(path)
    data = _parse(path)
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; known keys: {', '.join(TOP_KEYS)} "
                          "(and [models.ALIAS] sections)")
    python = data.get("python")
    if python is not None and not (isinstance(python, str) and python):
        raise ConfigError(f"{path}: python must be the path of an interpreter, as a string")
    default = data.get("default")
    if default is not None and not (isinstance(default, str) and default):
        raise ConfigError(f"{path}: default must be the alias of a model, as a string")
    network = data.get("network", {})
    if not isinstance(network, dict) or set(network) - {"allow"}:
        raise ConfigError(f"{path}: network must be a table holding only allow = [\"HOST[:PORT]\", ...] "
                          "([network] allow = [\"pypi.org\", \"files.pythonhosted.org\"])")
    allow = network.get("allow", [])
    if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
        raise ConfigError(f"{path}: network.allow must be a list of \"HOST[:PORT]\" strings")
    tables = data.get("models", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: models must be a table of [models.ALIAS] sections")
    for alias, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: models.{alias} must be a table ([models.{alias}]), not a value")
        _check_model(f"{path}: [models.{alias}]", table)
    return data


def _parse(path: Path) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such model configuration file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise ConfigError(f"{path}: not a regular file")
        trust.check(path, "the configuration", same_as=opened)
        try:
            return tomllib.loads(f.read().decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def _check_model(where: str, table: dict[str, Any]) -> None:
    unknown = sorted(set(table) - set(MODEL_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(MODEL_KEYS))}")
    for key in ("base_url", "model", "api_key_env", "protocol"):
        value = table.get(key, "-")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: {key} must be a non-empty string")
    for key, positive in (("price_in", False), ("price_out", False), ("timeout", True)):
        value = table.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise ConfigError(f"{where}: {key} must be {'positive' if positive else 'zero or more'}, got {value!r}")
    base_url = table.get("base_url")
    if base_url is not None and not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: base_url must start with http:// or https://, got {base_url!r}")
    protocol = table.get("protocol", "tags")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"{where}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    vision = table.get("vision")
    if vision is not None and not isinstance(vision, bool):
        raise ConfigError(f"{where}: vision must be true or false (whether the model takes images), got {vision!r}")
    for key in ("context_window", "max_tokens"):
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{where}: {key} must be a positive whole number of tokens, got {value!r}")
