"""The server's log set-up, and a rate limit on repeated lines: under a flood of failing
connections ("Too many open files" on every accept) the same line would otherwise be written
hundreds of thousands of times and fill the disk."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from afdserve.engine.log_format import LOG_FORMAT_ENV, JsonLines

RATE_WINDOW_S = 10.0
RATE_BURST = 20  # lines of one kind per window before the rest are counted, not written
# Records of these loggers themselves (uvicorn's accept errors, asyncio's "out of system
# resource"); afdserve's own lines pass the filter on afdserve's handler.
RATE_LIMITED_LOGGERS = ("uvicorn.error", "asyncio")
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class RateLimit(logging.Filter):
    """At most `burst` warnings or errors per (logger, message template) per `window_s`; the
    first record of the next window says how many were dropped. Info lines (one per request,
    the stats line) pass: their volume follows the traffic, not a fault."""

    def __init__(self, window_s: float = RATE_WINDOW_S, burst: int = RATE_BURST) -> None:
        super().__init__()
        self.window_s, self.burst = window_s, burst
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int, int]] = {}  # start, written, dropped

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            start, written, dropped = self._seen.get(key, (now, 0, 0))
            if now - start >= self.window_s:
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar lines dropped]"
                start, written, dropped = now, 0, 0
            if written >= self.burst:
                self._seen[key] = (start, written, dropped + 1)
                return False
            self._seen[key] = (start, written + 1, dropped)
            if len(self._seen) > 10_000:  # message templates are few; formatted ones are not
                self._seen.clear()
        return True


_RATE_LIMIT = RateLimit()


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonLines()
    return logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s")


def progress_line(message: str) -> str:
    """The server's progress lines (printed at any log level) in the format setup_logging set."""
    if os.environ.get(LOG_FORMAT_ENV) != "json":
        return f"afdserve: {message}"
    record = logging.LogRecord("afdserve.server", logging.INFO, __file__, 0, message, None, None)
    return JsonLines().format(record)


def setup_logging(level: str = "info", log_format: str = "text") -> None:
    """afdserve's own loggers print at `level` (the frontend's log.info included), in one format,
    whatever uvicorn's level is, rate limited. Python warnings go the same way, and the ranks
    this process starts inherit the format (LOG_FORMAT_ENV)."""
    logger = logging.getLogger("afdserve")
    handler = next((h for h in logger.handlers if getattr(h, "afdserve", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.afdserve = True  # type: ignore[attr-defined]
        handler.addFilter(_RATE_LIMIT)
        logger.addHandler(handler)
    handler.setFormatter(formatter(log_format))
    logger.setLevel("DEBUG" if level == "trace" else level.upper())
    logger.propagate = False
    os.environ[LOG_FORMAT_ENV] = log_format
    if log_format == "json":  # a warning printed as text would be the one line not JSON
        logging.captureWarnings(True)
        warnings = logging.getLogger("py.warnings")
        if handler not in warnings.handlers:
            warnings.addHandler(handler)
            warnings.propagate = False


def rate_limit_servers(log_format: str = "text") -> None:
    """Call after uvicorn configured its loggers: rate limits, and its handlers' format."""
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        if _RATE_LIMIT not in logger.filters:
            logger.addFilter(_RATE_LIMIT)
    if log_format == "json":
        for name in UVICORN_LOGGERS:
            for handler in logging.getLogger(name).handlers:
                handler.setFormatter(JsonLines())
