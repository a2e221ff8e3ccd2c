"""The tables of what else would run, for `lisaft estimate-memory`: what brings it under (the
advice), the optimizers side by side, every way to train; and how a figure is marked."""

from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from lisaft.memory.advice import Change
from lisaft.memory.estimate import Estimate


def human(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def human_pair(a: int, b: int) -> tuple[str, str]:
    """`a` and `b` as human() writes them, with as many more decimals (in the larger's unit) as it
    takes to show they differ: a verdict of 24.00 GiB > 24.00 GiB says nothing."""
    first, second = human(a), human(b)
    if a == b or first != second:
        return first, second
    unit, size = next(((u, s) for u, s in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
                       if max(abs(a), abs(b)) >= s), ("B", 1))
    for digits in range(3, 10):
        first, second = f"{a / size:.{digits}f} {unit}", f"{b / size:.{digits}f} {unit}"
        if first != second:
            return first, second
    return f"{a:,} B", f"{b:,} B"



def fit_mark(e: Estimate) -> str:
    """Whether an estimate fits, and when the GPU would hold it but something else does not, what."""
    if e.fits:
        return "fits"
    if e.fits_with_paging and not e.fits_host:
        return "no (host RAM)"  # the GPU holds it; the host memory it needs is more than the RAM
    if e.paged_state_bytes and e.fits_with_paging:
        return "paged"
    return "no"


HOST_RAM_NO = ("no (host RAM): the GPU holds it, but the host memory it needs (moments and copies in RAM with "
               "optimizer.cpu_offload, offloaded layer inputs) is more than the machine's RAM (--host-ram)")


def _change_cell(c: Change) -> Text:
    """One recipe key a line, then why, dimmed."""
    lines = [f"{k}: {json.dumps(v)}" for k, v in c.overrides.items()]
    if c.ranks:
        lines.append(f"torchrun --nproc-per-node {c.ranks}")
    cell = Text("\n".join(lines))
    cell.append("\n" + c.why, style="dim")
    return cell


def advice_table(changes: list[Change], host: bool = False) -> Table:
    """host: a column of each row's host RAM, when that RAM is what decides. A key is never cut:
    the first column is at least as wide as its widest key, and only the why wraps."""
    t = Table(title="What brings it under", title_justify="left")
    cells = [_change_cell(c) for c in changes]
    widest = max((len(line) for c, cell in zip(changes, cells) for line in cell.plain.splitlines()
                  if line != c.why), default=10)
    t.add_column("change (recipe keys; --set key=value), and why", min_width=widest, overflow="fold")
    t.add_column("total", justify="right", no_wrap=True)
    if host:
        t.add_column("host RAM", justify="right", no_wrap=True)
    t.add_column("fits")
    for c, cell in zip(changes, cells):
        ram = [human(c.estimate.host_bytes) if c.estimate.host_bytes else "-"] if host else []
        mark = fit_mark(c.estimate)
        t.add_row(cell, human(c.estimate.total_bytes), *ram, "yes" if mark == "fits" else mark)
    return t


def _column_title(key: str) -> str:
    if key in ("full", "lora"):
        return "full" if key == "full" else "as given (adapters)"
    return f"LISA γ={key.removeprefix('lisa_')}"


def grid_table(grid: dict, budget: int) -> Table:
    columns = sorted({k[1] for k in grid}, key=lambda c: (c != "lora", c != "full", c))
    t = Table(title=f"Optimizers side by side (budget {human(budget)})", title_justify="left",
              caption="each cell: the settings above with its optimizer.name, and lisa.enabled as its column says",
              caption_justify="left")
    t.add_column("optimizer", no_wrap=True)
    for c in columns:
        t.add_column(_column_title(c), justify="right")
    colour = {"fits": "green", "paged": "yellow"}
    for opt in dict.fromkeys(k[0] for k in grid):
        cells = []
        for c in columns:
            e = grid[(opt, c)]
            mark = fit_mark(e)
            cells.append(f"{human(e.total_bytes)} [{colour.get(mark, 'red')}]{mark}[/]")
        t.add_row(opt, *cells)
    return t


def methods_table(methods: list, budget: int, shared: str = "") -> Table:
    """Every way to train, in the order the learning benchmark ranked them; those that fit first.
    `shared`: the settings every row keeps from the ones it starts from."""
    caption = (f"each row: {shared}, model.gradient_checkpointing true, and the method's own keys (--json: "
               "methods[].set)") if shared else None
    t = Table(title=f"Ways to train it in {human(budget)}, by what they learned (fitting first)",
              title_justify="left", caption=caption, caption_justify="left")
    t.add_column("method", justify="left")
    t.add_column("peak", justify="right")
    t.add_column("learning", justify="left")
    for m in sorted(methods, key=lambda m: not m.estimate.fits):
        e = m.estimate
        mark = "[green]fits[/]" if e.fits else "[red]no[/]"
        if fit_mark(e) == "no (host RAM)":
            # The GPU would hold it; the moments in host memory would not fit this machine's RAM.
            mark = f"[red]no[/]: needs {human(e.host_bytes)} of host RAM (--host-ram)"
        t.add_row(m.name, f"{human(e.total_bytes)} {mark}", m.learned)
    return t
