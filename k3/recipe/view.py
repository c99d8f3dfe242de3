"""The progress view across a recipe's stages: stage k of n, elapsed, estimated remaining (from the recipe's
per-stage `minutes`, the running stage's estimate less its elapsed time), and the running command's last line.
On a terminal it is a rich live display; elsewhere (logs, tests) one plain line per event."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.text import Text


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class StageView:
    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.live: Live | None = None
        self.recipe = None
        self.index = 0
        self.stage = None
        self.stage_start = self.start_time = time.monotonic()
        self.last = ""
        self.done_before = 0.0  # seconds of stages completed in earlier attempts

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    # the recipe
    def start(self, recipe, state: dict) -> None:
        self.recipe, self.start_time = recipe, time.monotonic()
        self.note(f"recipe {recipe.name}: {len(recipe.stages)} stages, about "
                  f"{sum(s.minutes for s in recipe.stages):.0f} min estimated")
        if self.console.is_terminal:
            self.live = Live(self._render(), console=self.console, refresh_per_second=2, transient=True)
            self.live.start()

    def finish(self, state: dict) -> None:
        self._stop_live()
        total = sum(r.get("seconds", 0.0) for r in state["stages"].values())
        self.note(f"recipe {self.recipe.name}: all {len(self.recipe.stages)} stages done ({_clock(total)} in stages)")

    # stages
    def skipped(self, index: int, stage, record: dict) -> None:
        self._print(f"[{index + 1}/{len(self.recipe.stages)}] {stage.name}: done earlier "
                    f"({_clock(record.get('seconds', 0))})")

    def begin(self, index: int, stage, continuing: bool) -> None:
        self.index, self.stage, self.stage_start, self.last = index, stage, time.monotonic(), ""
        how = "continuing its stopped run" if continuing else "starting"
        self._print(f"[{index + 1}/{len(self.recipe.stages)}] {stage.name}: {how} (estimate {stage.minutes:g} min)")

    def command(self, line: str) -> None:
        self._print(f"  $ {line}")

    def output(self, line: str) -> None:
        self.last = line.strip()
        if self.live is not None:
            self.live.update(self._render())

    def end(self, index: int, stage, record: dict) -> None:
        self._print(f"[{index + 1}/{len(self.recipe.stages)}] {stage.name}: done in "
                    f"{_clock(time.monotonic() - self.stage_start)}")
        self.stage = None

    def failed(self, index: int, stage, error, log_path) -> None:
        self._stop_live()
        where = f" (its log: {log_path})" if log_path else ""
        name = stage.name if stage is not None else "recipe"
        self.console.print(Text(f"{name}: stopped with exit code {error.code}{where}", style="bold red"))
        if str(error):
            self.note(str(error))

    # the live display
    def _remaining(self) -> float:
        if self.recipe is None:
            return 0.0
        later = sum(s.minutes for s in self.recipe.stages[self.index + 1:]) * 60
        if self.stage is None:
            return later
        return later + max(0.0, self.stage.minutes * 60 - (time.monotonic() - self.stage_start))

    def _render(self) -> Text:
        n = len(self.recipe.stages) if self.recipe else 0
        name = self.stage.name if self.stage is not None else "…"
        text = Text()
        text.append(f"stage {self.index + 1} of {n}: {name}", style="bold")
        text.append(f"   elapsed {_clock(time.monotonic() - self.start_time)}"
                    f"   stage {_clock(time.monotonic() - self.stage_start)}"
                    f"   remaining ≈ {_clock(self._remaining())}")
        if self.last:
            text.append("\n  " + self.last[-(self.console.width - 4):], style="dim")
        return text

    def _print(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text, markup=False, highlight=False, soft_wrap=True)
            self.live.update(self._render())
        else:
            self.note(text)

    def _stop_live(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
