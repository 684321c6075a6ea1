"""TensorFlow's own log records kept out of the log while the engine tries a way to compute something.

When a conversion fails, TensorFlow writes pages to its Python logger (``tensorflow``) before it raises: pfor's
"Got error while pfor was converting op ..." with the op's inputs and a "Created at:" traceback per op, the
while_loop converter's dumps, fallback warnings. The engine tries several ways on purpose and says in one line
why each failed (``problem.error_summary``), so those pages only bury that line (issue 30: stderr of
``jacobian compute`` filled with them). ``captured()`` holds the ``tensorflow`` logger's records for the
duration of one attempt: an exception leaving it carries their count (``tf_logged``, which ``error_summary``
adds to its line), and an attempt that succeeds anyway is told in one line at DEBUG.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

TF_LOGGER = "tensorflow"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def first_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 - a record whose arguments do not format: its template
        text = str(record.msg)
    return (text.strip().splitlines() or [""])[0][:200]


@contextmanager
def captured(what: str = "") -> Iterator[list[logging.LogRecord]]:
    """The ``tensorflow`` logger's records (WARNING and above) collected, not printed, while the block runs;
    yields the list. An exception that leaves the block gets ``tf_logged`` (how many) and is re-raised."""
    if "tensorflow" in sys.modules:   # TensorFlow sets its logger up on first use: before, not inside, the block
        from tensorflow.python.platform import tf_logging

        tf_logging.get_logger()
    logger = logging.getLogger(TF_LOGGER)
    collect = _Collect()
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [collect], False
    try:
        yield collect.records
    except BaseException as err:
        if collect.records:
            try:
                err.tf_logged = getattr(err, "tf_logged", 0) + len(collect.records)  # type: ignore[attr-defined]
            except AttributeError:   # an exception type without a __dict__: the count is lost, nothing else
                pass
        raise
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    if collect.records:
        log.debug("%sTensorFlow logged %d lines (not shown), the first: %s", f"{what}: " if what else "",
                  len(collect.records), first_line(collect.records[0]))


def note(err: BaseException) -> str:
    """`` (TensorFlow logged N lines before it raised, not shown)`` for an exception from ``captured``, else ''."""
    n = getattr(err, "tf_logged", 0)
    return f" (TensorFlow logged {n} lines before this error; not shown)" if n else ""
