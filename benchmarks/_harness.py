"""What every benchmark script shares: its result rows, the device and the package versions they were measured with,
the writer of its results (a long-format CSV, one line per workload and system, and a markdown table), and the
helpers of comparisons with peers (torch's synchronisation, the relative error of a result).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import pathlib
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

# A result row: `workload`, `system`, `ms` (None: not timed, or failed), `note`, and the script's own columns.
Row = dict[str, Any]


# --- rows ---------------------------------------------------------------------------------------------------------

class Results:
    """A script's rows, in the order they were measured."""

    def __init__(self):
        self.rows: list[Row] = []

    def record(self, workload: str, system: str, ms: float | str | None = None, note: str = "", **columns) -> Row:
        """Adds a row (and prints it, so that a long run shows its progress)."""
        row = dict(workload=workload, system=system, ms=ms, note=note, **columns)
        self.rows.append(row)
        shown = [f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                 for key, value in row.items() if key not in ("workload", "system", "note") and value is not None]
        print(f"  {workload} | {system} | {', '.join(shown)}  {note or ''}", flush=True)
        return row

    def attempt(self, workload: str, system: str, run: Callable[[], dict], **columns) -> Row | None:
        """The row of `system` with the columns `run()` measures and `columns`; where `run` raises, the row of its
        failure instead (a peer that cannot run is a row, not the end of the benchmark), and None."""
        try:
            measured = run()
        except Exception as error:  # noqa: BLE001 (reported in the results, not fatal)
            traceback.print_exc(limit=2)
            self.record(workload, system, **{**columns, "note": failure(error)})
            return None
        return self.record(workload, system, **columns, **measured)


def failure(error: Exception) -> str:
    """The note of a system that failed: the error's type and its first line."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:120] if lines else ''}"


def baseline(rows: Sequence[Row], row: Row, is_base: Callable[[Row], bool], key: str = "ms"):
    """`key` of the first row of `row`'s workload that `is_base` picks and that has a value there: what `row` is
    compared with (None where no such row ran)."""
    return next((r[key] for r in rows if r["workload"] == row["workload"] and is_base(r) and r.get(key)), None)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """`numerator / denominator`, None where either is missing (a system that failed) or zero."""
    return numerator / denominator if numerator and denominator else None


# --- the device and the packages -----------------------------------------------------------------------------------

def device_name() -> str:
    """The kind of JAX's first device, as the results' titles name it."""
    return jax.devices()[0].device_kind


def device_file_name() -> str:
    """The device's name as the results' file names hold it."""
    return device_name().replace(" ", "_")


def package_versions(modules=("triton", "jax_triton", "torch", "torch_geometric")) -> dict[str, str]:
    """jax's version, and those of `modules` where they import: for the headers of the results."""
    versions = {"jax": jax.__version__}
    for module in modules:
        try:
            versions[module] = importlib.import_module(module).__version__
        except Exception:  # noqa: BLE001 (a missing or broken peer is left out of the header)
            pass
    return versions


def versions_text(modules=("triton", "jax_triton", "torch", "torch_geometric")) -> str:
    """`jax 0.11.2, triton 3.6.0, ...`: `package_versions(modules)` as the results' headers give them."""
    return ", ".join(f"{name} {version}" for name, version in package_versions(modules).items())


def command(script: str) -> str:
    """The command line that ran `script` (its `__file__`), as the results' headers quote it: without `--out`,
    where the results went (a path of the machine that ran it)."""
    arguments = list(sys.argv[1:])
    for flag in [i for i, a in enumerate(arguments) if a == "--out"][::-1]:
        del arguments[flag:flag + 2]
    return " ".join(["python", f"benchmarks/{pathlib.Path(script).name}", *arguments])


# --- the writer -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Column:
    """A column of a markdown table: its header, the key of the rows' values it shows, and how."""

    header: str
    key: str
    form: str = "{}"      # a number's format; text is shown as it is
    missing: str = ""     # shown where a row has no value (None, or no key)
    align: str = "---:"   # the markdown alignment: numbers right, text "---"

    def cell(self, row: Row) -> str:
        value = row.get(self.key)
        if value is None:
            return self.missing
        if isinstance(value, str):
            return value.replace("|", "/").replace("\n", " ")  # (a note that holds either would end the row)
        return self.form.format(value)


def text(header: str, key: str | None = None) -> Column:
    """A column of text (a workload's or a system's name, a note), left-aligned; `key` defaults to `header`."""
    return Column(header, key or header, align="---")


WORKLOAD, SYSTEM, NOTE = text("workload"), text("system"), text("note")


def markdown_table(columns: Sequence[Column], rows: Sequence[Row]) -> list[str]:
    """The lines of a markdown table of `rows`, a line a row."""
    return ["| " + " | ".join(c.header for c in columns) + " |", "|" + "|".join(c.align for c in columns) + "|",
            *("| " + " | ".join(c.cell(row) for c in columns) + " |" for row in rows)]


def write(stem: pathlib.Path, title: str, preamble: Sequence[str], columns: Sequence[Column], rows: Sequence[Row], *,
          csv_fields: Sequence[str] = (), after: Sequence[str] = ()) -> None:
    """Writes `<stem>.md`: the title, the `preamble` lines (what ran, with which versions, how it was timed), the
    table of `rows` and the lines `after`; and, given `csv_fields`, `<stem>.csv`, long format: a line a row, those
    keys' values unformatted (empty where a row has none). Prints the markdown."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    if csv_fields:
        with open(f"{stem}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=csv_fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    lines = [f"# {title}", "", *preamble, "", *markdown_table(columns, rows), *after]
    pathlib.Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


# --- comparisons with peers -----------------------------------------------------------------------------------------

def torch_on_cuda():
    """torch where it has CUDA, else None (its rows are left out)."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def sync_torch(_) -> None:
    """`time_calls`'s `sync` for a torch peer: waits for torch's CUDA work (the call's output is not needed)."""
    import torch  # noqa: PLC0415 (the peer imported it: a look-up, once a round of calls)

    torch.cuda.synchronize()


def relative_error(actual, expected) -> float:
    """The largest difference of `actual` from `expected` over the largest magnitude of `expected`, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


# The two forms of a kernel (the Hopper form of the tile core against the Triton form), timed interleaved.
BF16_PEAK = 989  # TFLOP/s, dense bf16 on an H100 or H200


def record_forms(results: Results, workload: str, times: dict[str, float], outputs: dict[str, np.ndarray],
                 flops: float, note: str = "") -> None:
    """The rows of one workload in each form: ms, TFLOP/s and its share of the peak, and against the first form
    its time ratio and largest difference."""
    first = next(iter(times))
    for form, seconds in times.items():
        results.record(workload, form, seconds * 1e3, note=note, tflops=flops / seconds / 1e12,
                       peak=flops / seconds / 1e12 / BF16_PEAK,
                       speedup=times[form] / times[first] if form != first else None,
                       diff=float(np.abs(outputs[form] - outputs[first]).max()) if form != first else None)


def write_forms(results: Results, out: pathlib.Path, stem: str, title: str, script: str, calls: int) -> None:
    """`out/<stem>_<device>.{md,csv}`: the rows of `record_forms`."""
    columns = [WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}"), Column("TFLOP/s", "tflops", "{:.0f}"),
               Column(f"of the bf16 peak ({BF16_PEAK})", "peak", "{:.0%}"),
               Column("time / Hopper form", "speedup", "{:.2f}"), Column("max abs diff", "diff", "{:.1e}"), NOTE]
    write(out / f"{stem}_{device_file_name()}", f"{title} on {device_name()}",
          [f"{versions_text()}; `{command(script)}`. ms: median of 7 interleaved rounds of {calls} back-to-back "
           "calls (`jinsum.timing.time_interleaved`)."], columns, results.rows,
          csv_fields=("workload", "system", "ms", "tflops", "speedup", "diff"))
