"""What a sandboxed process inherits of the coordinator's environment: one function, two policies.

``ALLOWLIST`` (workers, sample slots, the fork servers, the repo-tools process): only the
variables ``ENV_ALLOWLIST`` names, and those the run's settings add (``env_allow``), if set;
API keys, cloud credentials and tokens stay behind because nothing names them.  ``CALLER``
(``exec FILE``'s script, the user's own program): the caller's environment minus what
``engine.secrets`` calls a secret (by name, by value, or a model's key variable), plus what
``--env`` passes — as Codex's ``shell_environment_policy`` inherits, by default.

What a launcher adds on top is the process's own business, never the caller's: its home, its
temporary directory, what the sandbox needs, the start spec (``contract.start``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping

from engine.secrets import secret_names

__all__ = ["ALLOWLIST", "CALLER", "ENV_ALLOWLIST", "EnvPolicy", "environment"]

#: Variables a worker inherits from the coordinator's environment, if set.  Everything else
#: (API keys, cloud credentials, tokens) stays behind.
ENV_ALLOWLIST = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_NUMERIC",
                 "TERM", "TZ", "PYTHONIOENCODING", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
#: The search path an ``ALLOWLIST`` process gets when the coordinator has none.
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class EnvPolicy(enum.Enum):
    ALLOWLIST = "allowlist"  # named variables only: ENV_ALLOWLIST and the run's env_allow
    CALLER = "caller"  # the caller's, minus its secrets, plus what --env passes


ALLOWLIST = EnvPolicy.ALLOWLIST
CALLER = EnvPolicy.CALLER


def environment(policy: EnvPolicy, environ: Mapping[str, str] | None = None, *, allow: Iterable[str] = (),
                passed: Iterable[str] = (), configured: Iterable[str] = (),
                proxies: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a process started under ``policy`` inherits of ``environ`` (default ``os.environ``).

    ``ALLOWLIST``: the variables of ``ENV_ALLOWLIST`` and ``allow`` that are set, and a ``PATH``
    (``DEFAULT_PATH``) if none is.  ``CALLER``: every variable but the secrets
    (``engine.secrets.secret_names``; ``configured`` names the models' key variables), then
    ``passed``: ``NAME`` passes the caller's value (a secret too: asked for by name),
    ``NAME=VALUE`` sets one.  ``proxies``: the variables naming the process's way out
    (``--allow-net``'s forwarder), which replace whatever the caller's said."""
    environ = os.environ if environ is None else environ
    if policy is ALLOWLIST:
        env = {name: environ[name] for name in (*ENV_ALLOWLIST, *allow) if name in environ}
        env.setdefault("PATH", DEFAULT_PATH)
        env.update(proxies or {})
        return env
    env = dict(environ)
    for name in secret_names(environ, configured):
        del env[name]
    env.update(proxies or {})
    for item in passed:
        name, sep, value = item.partition("=")
        if sep:
            env[name] = value
        elif name in environ:
            env[name] = environ[name]
    return env
