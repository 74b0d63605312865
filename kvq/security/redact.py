"""Secrets out of everything kvq prints: Redis URLs lose their password (in the userinfo,
`redis://user:PASSWORD@host`, and in the query, `?password=PASSWORD`), log lines too.

`redacted_url` is for values kvq prints itself (`kvq config show`, the demo, bench reports);
`RedactingFilter` catches what libraries put in log records and exception texts (a redis-py
error may quote the URL it was given).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

# user:password@ inside any redis/rediss/unix URL (with a +cluster or +sentinel mode)
_URL_PASSWORD = re.compile(r"((?:rediss?|unix)(?:\+[a-z]+)?://[^:@/\s]*:)([^@\s]+)(@)")
# ?password=... or &ssl_password=... anywhere in a text (redis-py takes both from a URL)
_QUERY_PASSWORD = re.compile(r"([?&][A-Za-z_]*password=)([^&#\s]+)", re.IGNORECASE)


def redacted_url(url: str) -> str:
    """The URL without its password, for printing."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return redacted_text(url)
    if password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        url = urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))
    return _QUERY_PASSWORD.sub(r"\1***", url)


def redacted_text(text: str) -> str:
    """`text` with the password of every Redis URL in it replaced by `***` (userinfo and
    query)."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***\3", text))


class RedactingFilter(logging.Filter):
    """Rewrites each record's message (and exception text) without Redis URL passwords."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redacted_text(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            if redacted_text(text) != text:
                record.exc_text = redacted_text(text)
        return True


def install_log_redaction() -> None:
    """Redact every handler of the root logger (call after logging is configured)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
