"""Rich progress bar and final summary table for the embedded trainer."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class RichProgress:
    def __init__(self, warmup_steps: int, rl_steps: int, console: Console | None = None):
        self.console = console or Console()
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=self.console,
        )
        self.warm_task = self.bar.add_task("warm-up (SFT)", total=max(warmup_steps, 1), info="")
        self.rl_task = self.bar.add_task("RL", total=max(rl_steps, 1), info="")

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def warmup(self, step: int, loss: float) -> None:
        self.bar.update(self.warm_task, completed=step + 1, info=f"loss {loss:.3f}")

    def step(self, step: int, m: dict) -> None:
        self.bar.update(self.warm_task, completed=self.bar.tasks[self.warm_task].total)
        info = f"reward {m.get('reward/mean', 0):.3f}  H {m.get('actor/entropy', 0):.3f}"
        self.bar.update(self.rl_task, completed=step, info=info)


def summary_table(summary: dict) -> Table:
    before, after = summary["before"], summary["after"]
    t = Table(title="held-out evaluation (embedded default)")
    t.add_column("metric")
    t.add_column("before RL", justify="right")
    t.add_column("after RL", justify="right")
    t.add_column("change", justify="right")
    for k in sorted(set(before) & set(after)):
        b, a = before[k], after[k]
        t.add_row(k.removeprefix("eval/"), f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}")
    return t
