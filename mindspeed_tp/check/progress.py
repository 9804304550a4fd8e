"""A plain-stderr progress bar for rank 0 (no dependency): one line per step, redrawn in place on a
terminal, appended otherwise (logs and CI keep every step)."""
import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool, stream=None, width: int = 24):
        self.total, self.enabled, self.width = max(1, total), enabled, width
        self.stream = stream or sys.stderr
        self.done, self.start = 0, time.monotonic()
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()

    def step(self, label: str) -> None:
        """Announce the step about to run (``label``)."""
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"check [{bar}] {self.done}/{self.total} {time.monotonic() - self.start:6.1f}s  {label}"
        self.stream.write(("\r" + line.ljust(100)) if self.tty else line + "\n")
        self.stream.flush()
        self.done += 1

    def finish(self) -> None:
        if not self.enabled:
            return
        bar = "#" * self.width
        line = f"check [{bar}] {self.total}/{self.total} {time.monotonic() - self.start:6.1f}s  done"
        self.stream.write(("\r" + line.ljust(100) + "\n") if self.tty else line + "\n")
        self.stream.flush()
