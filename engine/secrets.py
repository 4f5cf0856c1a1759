"""What looks like a secret, in one place: the names and values kept from a script's
environment, and the redaction every URL passes before it is shown.

**Names.**  A variable whose name matches ``SECRET_PATTERNS`` (shell patterns, any case) is a
secret: the families of keys, tokens, passwords and credentials that tools name them by
(``*KEY*``, ``*SECRET*``, ``*TOKEN*``, ``*PASS*``, ``*_PWD``, ``*AUTH*``, ``*JWT*``, ``*_PAT``,
``*DSN*``, ``*WEBHOOK*``, ``*COOKIE*``, ``*CREDENTIAL*``, ``*PRIVATE*``), except the few
ordinary names those patterns would catch (``NOT_SECRETS``: ``PWD``, ``OLDPWD`` and git's
``*AUTHOR*``).  As Codex's ``shell_environment_policy`` does, by default.

**Values.**  Whatever its name, a value holding a URL with a password in its user part
(``postgres://user:PW@host``, ``redis://:PW@host``, percent-encoded or not), an ``http(s)``
URL with any user part (``https://TOKEN@github.com``), or a URL with a query parameter named
like a secret (``?password=``, ``?token=``, ``?sig=``, ...) is a secret too (``DATABASE_URL``, ``REDIS_URL``, ``HTTPS_PROXY``, ``PIP_INDEX_URL``,
``MONGODB_URI``).  A secret variable is not passed at all, rather than passed with the
password cut out: a script that needs it fails on a missing variable, which says what
happened, instead of on a refused login; ``exec --env NAME`` passes one anyway.

**Showing a URL.**  ``redact_url`` (one URL) and ``redact_urls`` (any text) replace the whole
user part of every URL — user and password: a token is often the user (``https://TOKEN@host``)
— with ``***``, and the value of each secret-named query parameter likewise.  Every message,
event, span attribute, log line and record that names an endpoint (the model's, the OTLP
collector's, a proxy) names it through them; the command line's one-line errors and the
recordings pass through ``redact_urls`` once more, whatever they quote.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping

__all__ = ["NOT_SECRETS", "SECRET_PATTERNS", "is_secret_name", "is_secret_value", "redact_url", "redact_urls",
           "secret_names"]

#: Variable names (shell patterns, any case) that hold secrets.
SECRET_PATTERNS = ("*KEY*", "*SECRET*", "*TOKEN*", "*PASS*", "*_PWD", "*AUTH*", "*JWT*", "*_PAT", "*DSN*",
                   "*WEBHOOK*", "*COOKIE*", "*CREDENTIAL*", "*PRIVATE*")
#: Ordinary names the patterns would catch (shell patterns, any case): never a secret by name.
NOT_SECRETS = ("PWD", "OLDPWD", "*AUTHOR*")
#: Query parameters (any case) whose value is a secret: passwords, keys, tokens, signatures.
_SECRET_PARAMS = ("*pass*", "*pwd*", "*key*", "*secret*", "*token*", "*auth*", "*sig*", "*credential*",
                  "*jwt*", "*session*", "*cookie*")

# scheme://userinfo@ — the user part ends at the last "@" before the host's "/", "?" or "#"
# (a raw "@" in a password is common, and invalid); no whitespace, quote or bracket inside.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#\s\"'<>\[\]{}]*)@")
# A query parameter: after "?" or "&", a name, "=", a value up to the next "&", "#" or blank.
_PARAM = re.compile(r"(?P<lead>[?&;])(?P<name>[A-Za-z0-9_.\-]+)=(?P<value>[^&#;\s\"'<>]*)")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p.upper()) for p in patterns)


def is_secret_name(name: str) -> bool:
    """Whether a variable called ``name`` holds a secret by its name alone."""
    return _matches(name, SECRET_PATTERNS) and not _matches(name, NOT_SECRETS)


def _secret_param(name: str) -> bool:
    return _matches(name, _SECRET_PARAMS)


def is_secret_value(value: str) -> bool:
    """Whether ``value`` holds a URL with a password (``user:PW@``, ``:PW@``), an ``http(s)``
    URL with any user part (a token is sent as the user: ``https://TOKEN@host``), or a URL with
    a secret-named query parameter that has a value."""
    if "://" not in value:
        return False
    for found in _USERINFO.finditer(value):
        _, colon, password = found["userinfo"].partition(":")
        if (colon and password) or (found["userinfo"] and found["scheme"].lower() in ("http://", "https://")):
            return True
    return any(_secret_param(m["name"]) and m["value"] for m in _PARAM.finditer(value))


def secret_names(environ: Mapping[str, str], configured: Iterable[str] = ()) -> set[str]:
    """The names of ``environ`` whose variables are secrets: by name (``is_secret_name``), by
    value (``is_secret_value``), or named by the model configuration as holding an API key
    (``configured``)."""
    configured = set(configured)
    return {name for name, value in environ.items()
            if name in configured or is_secret_name(name) or is_secret_value(value)}


def redact_url(url: str) -> str:
    """``url`` as it may be shown: its user part (user and password) and the values of its
    secret-named query parameters replaced by ``***``; anything else as it was."""
    return redact_urls(url)


def redact_urls(text: str) -> str:
    """``text`` with every URL in it shown as ``redact_url`` shows one."""
    if "://" not in text and "?" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}***@" if m["userinfo"] else m[0], text)
    if "?" in text:
        text = _PARAM.sub(lambda m: f"{m['lead']}{m['name']}=***" if _secret_param(m["name"]) and m["value"]
                          else m[0], text)
    return text
