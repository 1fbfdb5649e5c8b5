"""What a long job shows while it runs. On a terminal: a live bar with the ETA, a spinner while
something slow starts. Otherwise (a Slurm log, `make run > log.txt`): plain lines, flushed at
once, one at the first update, one every `every` units of work and one at the last."""

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()


def duration(seconds: float) -> str:
    """45s, 2m13s, 1h02m."""
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Bar:
    """`total` units of work (steps, episodes), `done` of them done before (a resumed run):
    a live bar when `live` and stdout is a terminal, else a line every `every` units (0: at
    the first and last only). Each shows the ETA: the time so far per unit, times the rest."""

    def __init__(self, label: str, total: int, done: int = 0, *, live: bool = True,
                 every: int = 10):
        self.label, self.total, self.done, self.every = label, total, done, every
        self.first, self.t0 = done, time.time()
        self.bar = Progress(TextColumn(label), MofNCompleteColumn(), BarColumn(bar_width=16),
                            TimeElapsedColumn(), TextColumn("{task.description}"),
                            console=console, disable=not (live and console.is_terminal))
        self.task = self.bar.add_task("", total=total, completed=done)

    def __enter__(self) -> "Bar":
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def advance(self, n: int = 1, text: str = "") -> None:
        before, self.done = self.done, self.done + n
        eta = (time.time() - self.t0) / (self.done - self.first) * (self.total - self.done)
        text = f"{text} | eta {duration(eta)}".lstrip(" |")
        self.bar.update(self.task, advance=n, description=text)
        if self.bar.disable and (before == self.first or self.done >= self.total or (
                self.every and self.done // self.every > before // self.every)):
            print(f"{self.label} {self.done}/{self.total} {text}", flush=True)


@contextmanager
def status(doing: str) -> Iterator[None]:
    """`doing` while the block runs (a spinner on a terminal, else a line), then how long it took."""
    t0, live = time.time(), console.is_terminal
    with console.status(doing) if live else nullcontext():
        if not live:
            print(f"{doing} ...", flush=True)
        yield
    print(f"{doing}: done in {duration(time.time() - t0)}", flush=True)

