"""``engine.secrets``: which names and values are secrets, and how a URL is shown."""

from __future__ import annotations

import pytest

from engine.secrets import is_secret_name, is_secret_value, redact_url, redact_urls


@pytest.mark.parametrize("name", ["SMTP_PASS", "BASIC_AUTH", "MYSQL_PWD", "GH_PAT", "GITHUB_PAT", "NPM_CONFIG__AUTH",
                                  "DOCKER_AUTH_CONFIG", "PGPASS", "VAULT_PASS", "CI_JOB_JWT", "SLACK_WEBHOOK",
                                  "SENTRY_DSN", "session_cookie", "GOOGLE_APPLICATION_CREDENTIALS", "PRIVATE_KEY",
                                  "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "PGPASSWORD", "passwd"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["PWD", "OLDPWD", "PATH", "HOME", "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "LANG",
                                  "PATHEXT", "SHELL", "TERM"])
def test_ordinary_names(name):
    assert not is_secret_name(name)


@pytest.mark.parametrize("value, shown", [
    ("postgres://user:pw@h:5432/db", "postgres://***@h:5432/db"),
    ("redis://:pw@h:6379", "redis://***@h:6379"),
    ("http://u:p%40ss@proxy:3128", "http://***@proxy:3128"),
    ("postgres://user:p@ss@host/db", "postgres://***@host/db"),  # a raw "@" in the password
    ("https://TOKEN@github.com/o/r.git", "https://***@github.com/o/r.git"),
    ("https://h/x?password=abc&page=2", "https://h/x?password=***&page=2"),
    ("https://h/x?X-Amz-Signature=abc", "https://h/x?X-Amz-Signature=***"),
    ("a https://u:p@x b and https://y/z", "a https://***@x b and https://y/z"),
])
def test_secret_values_and_how_they_are_shown(value, shown):
    assert is_secret_value(value) and redact_urls(value) == shown == redact_url(value)


@pytest.mark.parametrize("value", ["https://example.org/x?page=2", "ssh://git@example.org/repo", "plain text",
                                   "user@example.org", "http://127.0.0.1:8080/v1", "https://h/?token="])
def test_ordinary_values(value):
    assert not is_secret_value(value)
    assert redact_urls(value) == value or value.startswith("ssh://")  # (a user part is never shown)
