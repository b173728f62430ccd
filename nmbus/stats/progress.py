"""What ``nmbus report`` shows while Spark works, and where Spark's own output goes.

* ``jvm_output_to(path)``: while the JVM starts inside it, file descriptors 1
  and 2 point at ``path``; the JVM inherits them for good, so its warnings
  and log4j's console lines land in that file, not on the terminal.
* ``Progress``: one line on a terminal, rewritten in place: the elapsed time
  and the running stage with its tasks, read from the SparkContext's status
  tracker. Nothing at all when the stream is not a terminal.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO


@contextlib.contextmanager
def jvm_output_to(path: str) -> Iterator[None]:
    """Point stdout and stderr (the descriptors) at ``path`` while a JVM starts inside."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


def stage_text(tracker: Any) -> str:
    """The running stages, as ``stage 3: 5/8 tasks``; empty between stages."""
    parts = []
    for stage_id in sorted(tracker.getActiveStageIds()):
        info = tracker.getStageInfo(stage_id)
        if info is None:
            continue
        parts.append(f"stage {stage_id}: {info.numCompletedTasks}/{info.numTasks} tasks")
    return ", ".join(parts)


class Progress:
    """An updating ``Spark: 12.4s · stage 3: 5/8 tasks`` line on a terminal.

    ``attach(spark)`` once the session exists; before that the line shows the
    elapsed time alone (the JVM is starting). ``close()`` erases the line.
    """

    def __init__(
        self, label: str = "Spark", stream: TextIO | None = None, interval: float = 0.25
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._own: TextIO | None = None
        if self.enabled:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                # A copy of the terminal's descriptor: jvm_output_to may point fd 2
                # elsewhere while the line is being drawn.
                self._own = os.fdopen(os.dup(self.stream.fileno()), "w", encoding="utf-8")
                self.stream = self._own
        self.label = label
        self.interval = interval
        self.started = time.monotonic()
        self.tracker: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="nmbus-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach(self, spark: Any) -> None:
        self.tracker = spark.sparkContext.statusTracker()

    def line(self) -> str:
        text = f"{self.label}: {time.monotonic() - self.started:.1f}s"
        if self.tracker is None:
            return text + " · starting"
        try:
            stages = stage_text(self.tracker)
        except Exception:  # the session stopping under us: the time alone will do
            stages = ""
        return f"{text} · {stages}" if stages else text

    def _write(self, text: str) -> None:
        columns = shutil.get_terminal_size((80, 24)).columns - 1
        text = text[:columns]
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad + "\b" * pad)
        self.stream.flush()
        self._width = len(text)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._write(self.line())

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.stream.write("\r" + " " * self._width + "\r")
        self.stream.flush()
        if self._own is not None:
            self._own.close()
            self._own = None
