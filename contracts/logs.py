"""Structured logs for the API and the workers: one JSON object a line, the job id on every line of a job.

``configure_logging()`` puts one stderr handler on the root logger (and re-formats uvicorn's and
rq's own handlers) with ``JsonFormatter`` and ``JobContextFilter``. ``job_context(job_id)`` sets a
context variable that the filter copies into every record logged inside it, from any logger
(rq, the engine, this project), so a job's life can be followed with ``jq 'select(.job_id == "...")'``.

Settings, read from the environment when ``configure_logging`` runs:
``JACOBIAN_LOG_FORMAT`` (``json``, the default; ``text``; ``none`` leaves logging as it is) and
``JACOBIAN_LOG_LEVEL`` (``INFO``).
Fields a line may carry besides ``ts``, ``level``, ``logger`` and ``message``: ``job_id``,
``exc_info``, and whatever the call passed as ``extra={...}`` (for example the chunk plan).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

JOB_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("jacobian_job_id", default=None)

#: Threads named ``f"{prefix}{job_id}"`` (the result writer's upload thread) log under that job id
#: even though a new thread does not inherit context variables.
JOB_THREAD_PREFIXES = ("result-writer-",)

#: Loggers that keep their own handlers (``propagate = False``); their handlers get our format too.
OWN_HANDLER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "rq.worker", "rq.job", "rq.scheduler")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_HANDLER_MARK = "_jacobian_handler"


def current_job_id() -> str | None:
    """The job id of the job this code runs for, or None outside a job."""
    return JOB_ID.get()


@contextmanager
def job_context(job_id: str | None) -> Iterator[None]:
    """Within the block, every log record carries ``job_id`` (nested blocks restore the outer id)."""
    token = JOB_ID.set(str(job_id) if job_id is not None else None)
    try:
        yield
    finally:
        JOB_ID.reset(token)


def start_thread_in_context(target: Any, *args: Any, name: str | None = None,
                            daemon: bool = True) -> threading.Thread:
    """A started thread running ``target(*args)`` in a copy of the caller's context (its job id)."""
    ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(target, *args), name=name, daemon=daemon)
    thread.start()
    return thread


class JobContextFilter(logging.Filter):
    """Adds ``record.job_id`` from ``job_context`` (an explicit ``extra={"job_id": ...}`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "job_id", None) is None:
            job_id = JOB_ID.get()
            if job_id is None:
                name = threading.current_thread().name
                for prefix in JOB_THREAD_PREFIXES:
                    if name.startswith(prefix) and len(name) > len(prefix):
                        job_id = name[len(prefix):]
                        break
            record.job_id = job_id
        return True


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError):
            pass
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``message``,
    ``job_id`` when known, extras, ``exc_info`` (the formatted traceback) when there is one."""

    def __init__(self, *, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": _ANSI.sub("", record.getMessage()),
            **self.static,
        }
        job_id = getattr(record, "job_id", None)
        if job_id is not None:
            out["job_id"] = job_id
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, http_version, status = record.args
            out.update(client=client, method=method, path=path, status_code=status)
        for key, value in vars(record).items():
            if key not in _RESERVED and key != "job_id" and not key.startswith("_") and key not in out:
                out[key] = _jsonable(value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The plain format (``JACOBIAN_LOG_FORMAT=text``), with ``[job_id]`` when there is one."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        job_id = getattr(record, "job_id", None)
        return f"{text} [job {job_id}]" if job_id else text


def make_formatter(fmt: str = "json", **static: Any) -> logging.Formatter:
    """``JsonFormatter`` or ``TextFormatter`` by ``fmt`` (``Settings.log_format``)."""
    fmt = fmt.strip().lower()
    if fmt == "json":
        return JsonFormatter(static=static or None)
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"JACOBIAN_LOG_FORMAT: {fmt!r} is not a log format; use 'json' or 'text'")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a line is emitted (test runners swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(service: str | None = None, *, fmt: str = "json", level: str | int = "INFO",
                      stream: Any = None) -> logging.Handler | None:
    """Install (or replace) this project's handler on the root logger; idempotent.

    Plain ``StreamHandler``s already on the root (``logging.basicConfig``) are replaced so lines are
    not written twice; other handlers (pytest's, files) stay. uvicorn's and rq's own handlers get
    the same formatter and filter. ``service`` becomes a ``service`` field on JSON lines.
    ``fmt`` and ``level`` are ``Settings.log_format`` and ``log_level`` (``JACOBIAN_LOG_FORMAT``,
    ``JACOBIAN_LOG_LEVEL``). Returns the installed handler; None, changing nothing, when the format is
    ``none``.
    """
    if fmt.strip().lower() == "none":
        return None
    formatter = make_formatter(fmt, **({"service": service} if service else {}))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _HANDLER_MARK, False) or type(old) is logging.StreamHandler:
            root.removeHandler(old)
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(formatter)
    handler.addFilter(JobContextFilter())
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name in OWN_HANDLER_LOGGERS:
        for own in logging.getLogger(name).handlers:
            if isinstance(own, logging.StreamHandler):
                own.setFormatter(formatter)
                if not any(isinstance(f, JobContextFilter) for f in own.filters):
                    own.addFilter(JobContextFilter())
    return handler
