"""Model aliases: which endpoint, model id, key variable, context size and price each name means.

Two sources, both optional.  Environment variables (``LLM_URL``, ``LLM_MODEL``, ``LLM_TIMEOUT``,
``LLM_API_KEY``) describe one endpoint under the alias ``default``; an ``agentloop.toml`` file
describes any number of them::

    default = "flash"            # the alias used when none is named (optional)

    [models.flash]
    base_url = "http://127.0.0.1:8080/v1"
    model = "qwen3-coder"        # the id sent in requests (default: the alias)
    api_key_env = "LLM_API_KEY"  # name of the variable holding the key, never the key
    context_window = 32768
    price_in = 0.1               # USD per million prompt tokens
    price_out = 0.4              # USD per million completion tokens
    protocol = "tags"            # "tags" (<run_code> blocks) or "tools" (native tool calls)
    timeout = 300                # seconds per request
    max_tokens = 8192            # longest reply, sent as max_tokens (a cut reply is never an answer)
    vision = true                # the model takes images (default: as the server says; else not)

A key is sent only to an endpoint the user named (``LLM_URL``, or an alias's ``base_url``): the
built-in default ``DEFAULT_URL`` is a loopback port any local account may have bound first, so a
model that is there only by default gets no key (``unsent_key_note`` says so in one line).

The environment alias is kept next to the file's models when the user set ``LLM_URL`` or
``LLM_MODEL`` explicitly, or when the file defines no models; otherwise listing it would offer
the model an endpoint nobody configured.  Keys are never stored: only the variable's name is,
and it is read at request time.

``context_window`` left out means "ask the server" (``engine.models``); set, it wins over
whatever the server reports.  So with ``vision``: left out, llama-server's ``/props``
modalities or Ollama's capabilities decide, and a model no server speaks for gets no images.

The file is read and checked whole by ``engine.config``, its one reader.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.config import CONFIG_FILE, read_config
from engine.errors import ConfigError
from engine.secrets import redact_url

__all__ = [
    "DEFAULT_ALIAS", "DEFAULT_MAX_TOKENS", "DEFAULT_MODEL_ID", "DEFAULT_TIMEOUT",
    "DEFAULT_URL", "ModelConfig", "ModelRegistry", "load_models", "unsent_key_note", "which_wins"
]

DEFAULT_URL = "http://127.0.0.1:8080/v1"
DEFAULT_MODEL_ID = "qwen3-coder"
DEFAULT_TIMEOUT = 300.0
#: Longest reply asked for when the configuration names none: long enough for any code block
#: or answer, short enough that a model that never ends its turn stops within minutes.
DEFAULT_MAX_TOKENS = 8192
DEFAULT_ALIAS = "default"


@dataclass(frozen=True)
class ModelConfig:
    """One named model endpoint.  Holds the *name* of the key's environment variable, so the
    key itself never appears in a repr, a log line or an event.  ``url_named``: the user named
    ``base_url`` (``LLM_URL``, or the alias's own); False when it is only ``DEFAULT_URL``, which
    then gets no key."""

    alias: str
    base_url: str
    model: str
    api_key_env: str = "LLM_API_KEY"
    context_window: int | None = None
    price_in: float = 0.0
    price_out: float = 0.0
    protocol: str = "tags"
    timeout: float = DEFAULT_TIMEOUT
    max_tokens: int = DEFAULT_MAX_TOKENS
    #: Whether the model takes images (``image_url`` parts); None: as its server says.
    vision: bool | None = None
    url_named: bool = True

    @property
    def shown_url(self) -> str:
        """``base_url`` as every message, banner and record names it: its user and password
        (a key or a token, often) replaced by ``***`` (``engine.secrets.redact_url``)."""
        return redact_url(self.base_url)

    def api_key(self) -> str | None:
        """The key from the environment, read now (so a key exported later is picked up); None if
        unset, and None for an endpoint nobody named (see the module docstring)."""
        return (os.environ.get(self.api_key_env) or None) if self.url_named else None

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        """USD for that many prompt and completion tokens at this model's prices."""
        return (tokens_in * self.price_in + tokens_out * self.price_out) / 1_000_000

    def describe(self, *, context_from: str = "") -> str:
        """One line for the system prompt: alias, model id, context and prices when known;
        ``context_from`` says where the context size came from (``agentloop models``)."""
        details = []
        if self.context_window:
            details.append(f"context {self.context_window}" + (f" {context_from}" if context_from else ""))
        if self.price_in or self.price_out:
            details.append(f"${self.price_in:.2f}/${self.price_out:.2f} per M tokens")
        suffix = f" ({', '.join(details)})" if details else ""
        return f"- {self.alias}: {self.model}{suffix}"


class ModelRegistry:
    """The aliases known to this run, in definition order, and which one is the default."""

    def __init__(self, models: Mapping[str, ModelConfig], default: str) -> None:
        if not models:
            raise ConfigError("no models configured")
        if default not in models:
            raise ConfigError(f"default model {default!r} is not defined; known aliases: {', '.join(models)}")
        self._models = dict(models)
        self._default = default

    @property
    def default(self) -> ModelConfig:
        return self._models[self._default]

    def get(self, name: str | None = None) -> ModelConfig:
        """The model for an alias, or failing that for a model id; the default for None or "".

        An unknown name raises ConfigError listing the aliases, worded so a model can read it
        and pick again."""
        if not name:
            return self.default
        if name in self._models:
            return self._models[name]
        for config in self._models.values():
            if config.model == name:
                return config
        raise ConfigError(f"unknown model {name!r}; known aliases: {', '.join(self._models)}")

    def aliases(self) -> list[str]:
        return list(self._models)

    def describe(self, learned: Mapping[str, ModelConfig] | None = None) -> str:
        """The "Available models:" lines of the system prompt, one per alias; ``learned`` holds
        configs completed with what their servers reported, used in place of the alias's own."""
        learned = learned or {}
        return "\n".join(learned.get(alias, config).describe() for alias, config in self._models.items())

    def replace_all(self, **changes: Any) -> ModelRegistry:
        """A registry whose every model has ``changes`` applied (``--max-tokens`` on the command line)."""
        return ModelRegistry({alias: replace(config, **changes) for alias, config in self._models.items()},
                             self._default)

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[ModelConfig]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def __repr__(self) -> str:
        return f"ModelRegistry(aliases={self.aliases()!r}, default={self._default!r})"


def load_models(path: str | Path | None = None, env: Mapping[str, str] = os.environ) -> ModelRegistry:
    """The registry from the environment plus, when present, a TOML file.

    With ``path=None`` the file ``./agentloop.toml`` is read if it exists; a path that is given
    must exist.  Any problem raises ConfigError naming the file and what to fix.  ``env`` supplies
    LLM_URL / LLM_MODEL / LLM_TIMEOUT; keys are always read from the process environment, when a
    request is made (see ``ModelConfig.api_key``)."""
    env_model = _from_env(env)
    if path is None:
        candidate = Path(CONFIG_FILE)
        if not candidate.is_file():
            return ModelRegistry({DEFAULT_ALIAS: env_model}, DEFAULT_ALIAS)
        path = candidate
    path = Path(path)
    file_models, file_default = _file_models(read_config(path), env_model)

    models: dict[str, ModelConfig] = {}
    env_explicit = "LLM_URL" in env or "LLM_MODEL" in env
    if (not file_models or env_explicit) and DEFAULT_ALIAS not in file_models:
        models[DEFAULT_ALIAS] = env_model
    models.update(file_models)

    if file_default is not None:
        if file_default not in models:
            raise ConfigError(f"{path}: default = {file_default!r} names no model; "
                              f"define [models.{file_default}] or use one of: {', '.join(models)}")
        default = file_default
    else:
        default = DEFAULT_ALIAS if DEFAULT_ALIAS in models else next(iter(models))
    return ModelRegistry(models, default)


def which_wins(registry: ModelRegistry, path: str | Path | None = None,
               env: Mapping[str, str] = os.environ) -> str:
    """When LLM_URL is set and a model file is read too, which of them the default model comes
    from, in one sentence ("" when only one of them is in play): otherwise a user who exported
    LLM_URL cannot tell that a file in the current directory overrides it."""
    file = Path(path) if path is not None else Path(CONFIG_FILE)
    url = env.get("LLM_URL")
    if not url or not file.is_file():
        return ""
    default = registry.default
    if default.alias == DEFAULT_ALIAS and default == _from_env(env):
        return (f"LLM_URL and {file} are both set: LLM_URL wins, the default model is {default.model} at "
                f"{default.shown_url} (alias {DEFAULT_ALIAS!r}); the file's aliases are used when named "
                "(--model ALIAS, model=\"ALIAS\")")
    kept = (f"LLM_URL is used only as the alias {DEFAULT_ALIAS!r} (--model {DEFAULT_ALIAS})"
            if DEFAULT_ALIAS in registry and registry.get(DEFAULT_ALIAS) == _from_env(env)
            else "LLM_URL is used only as the base_url of aliases that set none")
    return (f"LLM_URL and {file} are both set: {file} wins, the default model is {default.alias!r} "
            f"({default.model} at {default.shown_url}); {kept}")


def unsent_key_note(registry: ModelRegistry, env: Mapping[str, str] = os.environ) -> str:
    """One sentence when a key is set for an alias whose endpoint is only the built-in default
    (so the key is not sent); "" otherwise."""
    for config in registry:
        if not config.url_named and env.get(config.api_key_env):
            return (f"${config.api_key_env} is set but no model URL was named, so no key is sent to the built-in "
                    f"default {config.base_url} (a port any local account may hold); set LLM_URL, or base_url "
                    "in agentloop.toml, to the server the key is for")
    return ""


def _from_env(env: Mapping[str, str]) -> ModelConfig:
    url = env.get("LLM_URL") or DEFAULT_URL
    timeout_text = env.get("LLM_TIMEOUT") or str(DEFAULT_TIMEOUT)
    try:
        timeout = float(timeout_text)
    except ValueError:
        raise ConfigError(f"LLM_TIMEOUT must be a number of seconds, got {timeout_text!r}") from None
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ConfigError(f"LLM_TIMEOUT must be a positive number of seconds, got {timeout_text!r}")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"LLM_URL must start with http:// or https://, got {url!r}")
    return ModelConfig(alias=DEFAULT_ALIAS, base_url=url.rstrip("/"), model=env.get("LLM_MODEL") or DEFAULT_MODEL_ID,
                       timeout=timeout, url_named=bool(env.get("LLM_URL")))


def _file_models(data: dict[str, Any], env_model: ModelConfig) -> tuple[dict[str, ModelConfig], str | None]:
    """The models of a file ``engine.config.read_config`` has checked: each alias's table applied
    over the defaults (the environment's endpoint and timeout)."""
    models = {alias: _model(alias, table, env_model) for alias, table in data.get("models", {}).items()}
    return models, data.get("default")


def _model(alias: str, table: dict[str, Any], env_model: ModelConfig) -> ModelConfig:
    return ModelConfig(
        alias=alias,
        base_url=table.get("base_url", env_model.base_url).rstrip("/"),
        model=table.get("model", alias),
        api_key_env=table.get("api_key_env", "LLM_API_KEY"),
        context_window=table.get("context_window"),
        price_in=float(table.get("price_in", 0.0)),
        price_out=float(table.get("price_out", 0.0)),
        protocol=table.get("protocol", "tags"),
        timeout=float(table.get("timeout", env_model.timeout)),
        max_tokens=table.get("max_tokens") or DEFAULT_MAX_TOKENS,
        vision=table.get("vision"),
        url_named="base_url" in table or env_model.url_named,
    )
