"""How kvq's processes log: one line a record on stderr, as text (default) or, with
`KVQ_LOG_FORMAT=json`, one JSON object a line for log collectors (Loki, Elasticsearch, ...):
`{"ts", "level", "logger", "message"}`, plus `"exc"` with the traceback when there is one.
Every handler redacts Redis URL passwords (`kvq.security.redact`)."""

from __future__ import annotations

import json
import logging
import sys
import time

from kvq.security.redact import install_log_redaction

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.created * 1000) % 1000
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False)


def configure(verbose: bool, fmt: str = "text") -> None:
    """The root logger for a kvq process (`fmt`: text or json). Like `logging.basicConfig`, it
    leaves a root logger that has handlers already alone (a host program's, pytest's), but for
    the redaction."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("gguf").setLevel(logging.WARNING)
    install_log_redaction()
