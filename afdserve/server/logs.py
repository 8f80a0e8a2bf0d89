"""The server's log set-up, with two guards on what reaches the log:

- every record is bounded (`Bounded`): the values in it (a request's field names, a path, an
  exception's text) cut to MAX_FIELD_BYTES each and the message to MAX_MESSAGE_BYTES, control
  characters escaped, a traceback cut and its lines indented. So a request cannot write more than
  a few kB of log, nor a line of its own ("x\\nERROR ... FORGED" as a field name), in either format.
- a rate limit on warnings and errors, in lines and in bytes: under a flood of failing
  connections ("Too many open files" on every accept) the same line would otherwise be written
  hundreds of thousands of times and fill the disk.
"""

from __future__ import annotations

import logging
import numbers
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from afdserve.engine.log_format import LOG_FORMAT_ENV, JsonLines

MAX_FIELD_BYTES = 1024  # one value in a line: a field name, a path, an exception's text
MAX_MESSAGE_BYTES = 4096
MAX_TRACEBACK_BYTES = 8192
RATE_WINDOW_S = 10.0
RATE_BURST = 20  # lines of one kind per window before the rest are counted, not written
RATE_BURST_BYTES = 16 * 1024  # bytes of one kind per window
RATE_TOTAL_BYTES = 64 * 1024  # bytes of warnings and errors of all kinds per window
# Records of these loggers themselves (uvicorn's accept errors, asyncio's "out of system
# resource"); afdserve's own lines pass the filters on afdserve's handler.
RATE_LIMITED_LOGGERS = ("uvicorn.error", "asyncio")
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")

# C0 and C1 controls but the newline, DEL, line and paragraph separators, bidirectional overrides
# (which reorder what a terminal shows), and lone surrogates (from a JSON "\\ud800"; they cannot
# be encoded).
_UNSAFE_BUT_NEWLINE_CHARS = (
    "\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
)
_UNSAFE = re.compile(f"[\n{_UNSAFE_BUT_NEWLINE_CHARS}]")
_UNSAFE_BUT_NEWLINE = re.compile(f"[{_UNSAFE_BUT_NEWLINE_CHARS}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def bounded(text: str, limit: int = MAX_FIELD_BYTES, unsafe: re.Pattern = _UNSAFE) -> str:
    """`text` with its unsafe characters escaped as Python writes them (\\n, \\x1b, \\u2028), cut to
    `limit` bytes of UTF-8, saying how long it was."""
    shown = unsafe.sub(_escape, text[:limit])
    data = shown.encode()
    if len(data) <= limit and len(text) <= limit:
        return shown
    return data[:limit].decode(errors="ignore") + f"...[cut: {len(text)} characters in all]"


def bounded_traceback(text: str) -> str:
    """A traceback cut to MAX_TRACEBACK_BYTES with its unsafe characters escaped but its newlines,
    and every line indented: in the text format a record's own line is the only one that starts
    at the margin, whatever an exception's message says."""
    text = bounded(text, MAX_TRACEBACK_BYTES, _UNSAFE_BUT_NEWLINE)
    return "\n".join(line if line.startswith(" ") else "  " + line for line in text.split("\n"))


def few(names: Sequence[str], most: int = 8, each: int = 64) -> str:
    """Names for a log line: the first `most`, each cut to `each` bytes, and how many in all."""
    shown = ", ".join(bounded(name, each) for name in names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"


def _bounded_value(value: object) -> object:
    if isinstance(value, numbers.Number):  # %d and %.2f need the number itself
        return value
    return bounded(value if isinstance(value, str) else str(value))


class Bounded(logging.Filter):
    """Bounds every record before any formatter sees it (see the module's docstring). The
    arguments stay arguments where the message fits (uvicorn's access formatter reads them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "afdserve_bounded", False):
            return True
        template = str(record.msg)
        if isinstance(record.args, Mapping):
            record.args = {k: _bounded_value(v) for k, v in record.args.items()}
        elif record.args:
            record.args = tuple(_bounded_value(v) for v in record.args)
        if record.args:
            try:
                message = record.getMessage()
            except (TypeError, ValueError):  # logging reports a bad template itself
                message = ""
            if len(message) > MAX_MESSAGE_BYTES:
                record.msg, record.args = bounded(message, MAX_MESSAGE_BYTES), None
            else:
                record.msg = _UNSAFE.sub(_escape, template)
        else:
            record.msg = bounded(template, MAX_MESSAGE_BYTES)
        if record.exc_info and not record.exc_text:
            record.exc_text = bounded_traceback(
                logging.Formatter().formatException(record.exc_info)
            )
        record.afdserve_bounded = True
        return True


class BoundedJsonLines(JsonLines):
    """JsonLines with the traceback cut (JsonLines formats it anew, without exc_text)."""

    def formatException(self, ei: object) -> str:  # noqa: N802 (logging's name)
        return bounded(super().formatException(ei), MAX_TRACEBACK_BYTES, _UNSAFE_BUT_NEWLINE)


class RateLimit(logging.Filter):
    """At most `burst` warnings or errors, and `burst_bytes` of them, per (logger, message
    template) per `window_s`, and `total_bytes` of all kinds; the first record of a kind written
    in a later window says how many of that kind were dropped. Info lines (one per request, the
    stats line) pass: their volume follows the traffic, not a fault, and each is bounded."""

    def __init__(
        self,
        window_s: float = RATE_WINDOW_S,
        burst: int = RATE_BURST,
        burst_bytes: int = RATE_BURST_BYTES,
        total_bytes: int = RATE_TOTAL_BYTES,
    ) -> None:
        super().__init__()
        self.window_s, self.burst = window_s, burst
        self.burst_bytes, self.total_bytes = burst_bytes, total_bytes
        self._lock = threading.Lock()
        # (logger, template) -> window start, lines and bytes written, lines dropped
        self._seen: dict[tuple[str, str], tuple[float, int, int, int]] = {}
        self._total_start, self._total = 0.0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        size = len(record.getMessage().encode(errors="replace")) + len(record.exc_text or "")
        now = time.monotonic()
        with self._lock:
            if now - self._total_start >= self.window_s:
                self._total_start, self._total = now, 0
            start, lines, written, dropped = self._seen.get(key, (now, 0, 0, 0))
            if now - start >= self.window_s:
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar lines dropped]"
                start, lines, written, dropped = now, 0, 0, 0
            if (
                lines >= self.burst
                or (lines and written + size > self.burst_bytes)
                or (self._total and self._total + size > self.total_bytes)
            ):
                self._seen[key] = (start, lines, written, dropped + 1)
                return False
            self._seen[key] = (start, lines + 1, written + size, dropped)
            self._total += size
            if len(self._seen) > 10_000:  # message templates are few; formatted ones are not
                self._seen.clear()
        return True


_RATE_LIMIT = RateLimit()
_BOUNDED = Bounded()


def _guard(filterer: logging.Filterer, rate_limit: bool = True) -> None:
    """Bound first, so that the rate limit counts the bytes that will be written."""
    if _BOUNDED not in filterer.filters:
        filterer.filters.insert(0, _BOUNDED)
    if rate_limit and _RATE_LIMIT not in filterer.filters:
        filterer.addFilter(_RATE_LIMIT)


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return BoundedJsonLines()
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
        _guard(handler)
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
    """Call after uvicorn configured its loggers: bounds and rate limits on the records of
    uvicorn's and asyncio's loggers, and uvicorn's handlers' format."""
    for name in (*RATE_LIMITED_LOGGERS, "uvicorn.access"):
        _guard(logging.getLogger(name), rate_limit=name in RATE_LIMITED_LOGGERS)
    if log_format == "json":
        for name in UVICORN_LOGGERS:
            for handler in logging.getLogger(name).handlers:
                handler.setFormatter(BoundedJsonLines())
