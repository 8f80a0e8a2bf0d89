"""Log lines as JSON (`afdserve serve --log-format json`): one object per line, with time, level,
logger and message, for log pipelines that parse rather than grep. Here, below the server, so
that rank processes format their lines the same way: the frontend names the format in the
environment its ranks inherit (LOG_FORMAT_ENV)."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "AFDSERVE_LOG_FORMAT"


class JsonLines(logging.Formatter):
    """One JSON object per record; a traceback travels in "exception" (newlines escaped, so the
    record stays one line). `fields` are added to every object (a rank's number)."""

    def __init__(self, **fields: object) -> None:
        super().__init__()
        self.fields = fields

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)
