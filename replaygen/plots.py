"""PNG plots of a saved `replaygen bench` JSON (matplotlib is the optional extra `replaygen[plot]`).

Per shape in the JSON, into OUT_DIR (default: the JSON's folder):

    <spec>_<shape>_speedup.png   speedup over the baseline vs batch: decode kernels; replay verify per window T
    <spec>_<shape>_capacity.png  replay decode time per step vs buffer capacity L, one panel per batch, with the
                                 traffic model's time at the measured copy bandwidth and the baseline's
    <spec>_<shape>_verify.png    verify step cost vs T, in baseline decode steps, one panel per batch
    <spec>_<shape>_roofline.png  fraction of the measured copy bandwidth vs batch (decode; verify per T)

A plot whose rows the JSON lacks (a run without --L or --T) is left out. Only the object-oriented
matplotlib API is used (no pyplot, no global backend state).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from replaygen.errors import ReplaygenError
from replaygen.spec.loader import SHAPE_NAME, SPEC_NAME

log = logging.getLogger(__name__)

Row = dict[str, Any]
PANEL_COLUMNS = 3
# Legend text of the verify acceptance patterns (measure.VerifyWorkload).
ACCEPT_LABELS = {"all": "all accepted", "staggered": "all accepted, flushes staggered", "random": "random acceptance"}
NUMBER = (int, float)
# The fields the plots read from each section's rows (bench.DecodeRow, CapacityRow, VerifyRow), and their types; a
# verify row's decode_shape (see _shape_of) is checked where there is one.
ROW_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "decode": {"shape": str, "batch": int, "kernel": str, "flush_at": int, "speedup": NUMBER, "bandwidth_fraction": NUMBER},
    "capacity_sweep": {"shape": str, "batch": int, "capacity": int, "timing": dict, "model_ms": NUMBER, "baseline_ms": NUMBER,
                       "baseline_model_ms": NUMBER},
    "verify": {"shape": str, "batch": int, "tokens": int, "kernel": str, "accept": str, "vs_decode": NUMBER, "vs_baseline_verify": NUMBER,
               "bandwidth_fraction": NUMBER},
}
TIMING_FIELDS = ("median_ms", "p20_ms", "p80_ms")


class MatplotlibMissing(ReplaygenError):
    """Plots were asked for but matplotlib is not installed."""


def require_matplotlib() -> None:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise MatplotlibMissing("matplotlib not installed (pip install 'replaygen[plot]'): no plots written") from None


def plot_bench(json_path: Path, out_dir: Path | None = None) -> list[Path]:
    """Write every plot the bench JSON at `json_path` has rows for; returns the PNG paths."""
    require_matplotlib()
    result = read_bench(json_path)
    out_dir = out_dir or json_path.parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ReplaygenError(f"{out_dir}: a file stands at it or at a folder above it, not a folder for the plots") from None
    written = []
    for shape in _shapes(result):
        for name, plot in PLOTS.items():
            figure = plot(result, shape)
            if figure is None:
                log.info("%s: no rows for the %s plot", shape, name)
                continue
            path = out_dir / f"{result['spec']}_{shape}_{name}.png"
            figure.savefig(path, dpi=120)
            written.append(path)
    return written


def read_bench(json_path: Path) -> Row:
    """The bench JSON at `json_path`, checked to hold what the plots read (ReplaygenError naming the file and the
    first field missing or wrong). Its spec and shape names form the PNG file names, so names the spec loader would
    refuse (e.g. "../x") are refused here too, rather than let a plot land outside the output folder."""
    if not json_path.is_file():
        raise ReplaygenError(f"no bench JSON at {json_path}")
    try:
        result = json.loads(json_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReplaygenError(f"{json_path}: not a bench JSON ({exc})") from None
    if not isinstance(result, dict):
        raise ReplaygenError(f"{json_path}: not a bench JSON (the object `bench --out` writes) but {_json_type(result)}")
    if not isinstance(result.get("spec"), str) or not SPEC_NAME.fullmatch(result["spec"]):
        raise ReplaygenError(f"{json_path}: 'spec' missing or not a spec name (lowercase letters, digits and '_'): got {result.get('spec')!r}")
    if "decode" not in result:
        raise ReplaygenError(f"{json_path}: no 'decode' rows (not a JSON of `bench --out`)")
    for section, fields in ROW_FIELDS.items():
        rows = result.get(section, [])
        if not isinstance(rows, list):
            raise ReplaygenError(f"{json_path}: '{section}' must be a list of rows, got {_json_type(rows)}")
        for index, row in enumerate(rows):
            _check_row(row, fields, f"{json_path}: {section}[{index}]")
    return result


def _check_row(row: object, fields: dict[str, type | tuple[type, ...]], where: str) -> None:
    """ReplaygenError naming `where` unless `row` is an object with `fields` of their types (shape names as the spec allows)."""
    if not isinstance(row, dict):
        raise ReplaygenError(f"{where}: a row must be an object, got {_json_type(row)}")
    for field, kind in fields.items():
        value = row.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ReplaygenError(f"{where}: '{field}' missing or not {_type_name(kind)} (got {value!r})")
        if field == "timing" and not all(isinstance(value.get(key), NUMBER) for key in TIMING_FIELDS):
            raise ReplaygenError(f"{where}: 'timing' must hold the numbers {', '.join(TIMING_FIELDS)} (got {value!r})")
    for field in ("shape", "decode_shape"):
        if field in row and not (isinstance(row[field], str) and SHAPE_NAME.fullmatch(row[field])):
            raise ReplaygenError(f"{where}: '{field}' must be a shape name (lowercase letters, digits, '-' and '.'), got {row[field]!r}")


def _type_name(kind: type | tuple[type, ...]) -> str:
    return "a number" if kind == NUMBER else {str: "a string", int: "an integer", dict: "an object"}[kind]


def _json_type(value: object) -> str:
    """What a parsed JSON value is, in JSON's words."""
    kinds = ((bool, "a boolean"), (NUMBER, "a number"), (str, "a string"), (list, "an array"), (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def _shapes(result: Row) -> list[str]:
    """Shape names in order of first appearance."""
    rows = [*result["decode"], *result.get("capacity_sweep", []), *result.get("verify", [])]
    return list(dict.fromkeys(_shape_of(r) for r in rows))


def _shape_of(row: Row) -> str:
    """The benchmarked shape a row belongs to: a verify row's decode shape (each window T runs on its own verify
    shape, e.g. nemotron-h-mtp for T=4, but all are measured against the decode step of one benchmarked shape)."""
    return row.get("decode_shape", row["shape"])


def _rows(result: Row, key: str, shape: str, **match: object) -> list[Row]:
    return [r for r in result.get(key, []) if _shape_of(r) == shape and all(r[k] == v for k, v in match.items())]


def _title(result: Row, shape: str, what: str) -> str:
    gpu = result.get("environment", {}).get("gpu", "unknown GPU")
    cut = " (run cut short)" if result.get("complete") is False else ""
    return f"{result['spec']} {shape}: {what}\n{gpu}, {result.get('activation_dtype', '?')} activations{cut}"


def _panels(count: int, title: str) -> tuple[Any, list[Any]]:
    """A figure with `count` axes in rows of at most PANEL_COLUMNS (extra axes hidden)."""
    from matplotlib.figure import Figure

    columns = min(count, PANEL_COLUMNS)
    lines = math.ceil(count / columns)
    figure = Figure(figsize=(5.2 * columns, 3.9 * lines + 0.6), layout="constrained")
    axes = list(figure.subplots(lines, columns, squeeze=False).flat)
    for ax in axes[count:]:
        ax.set_visible(False)
    figure.suptitle(title)
    return figure, axes[:count]


def _log2_axis(ax: Any, values: Iterable[int], label: str) -> None:
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(label)


def _median(row: Row) -> float:
    return row["timing"]["median_ms"]


def _spread(rows: list[Row]) -> list[list[float]]:
    """Asymmetric error bars (median - p20, p80 - median) of timed rows."""
    return [[_median(r) - r["timing"]["p20_ms"] for r in rows], [r["timing"]["p80_ms"] - _median(r) for r in rows]]


def _decode_label(kernel: str, flush_at: int, tuned: bool) -> str:
    if kernel == "fla":
        return "FLA fused_recurrent_gated_delta_rule"
    if kernel == "baseline":
        return "baseline"
    route = kernel.split("/", 1)[1].replace("_", "-")
    if tuned:
        return f"replay {route} (tuned per batch)"
    return f"replay {route} ({'flush every step' if flush_at == 1 else f'flush every {flush_at}'})"


def _tuned(result: Row) -> bool:
    """Whether decode ran the configs built from tuning records (`bench --gpu`)."""
    return result.get("decode_configs") == "tuning records"


def _decode_series(rows: list[Row], tuned: bool = False) -> dict[str, list[Row]]:
    """Decode rows by kernel label, each sorted by batch (tuned: one replay series, whatever each bucket's flush_at)."""
    series: dict[str, list[Row]] = {}
    for r in sorted(rows, key=lambda r: r["batch"]):
        series.setdefault(_decode_label(r["kernel"], r["flush_at"], tuned), []).append(r)
    return series


def _verify_series(rows: list[Row], kernels: tuple[str, ...]) -> dict[tuple[int, str, str], list[Row]]:
    """Verify rows of `kernels` by (T, kernel, acceptance), each sorted by batch."""
    series: dict[tuple[int, str, str], list[Row]] = {}
    for r in sorted(rows, key=lambda r: r["batch"]):
        if r["kernel"] in kernels:
            series.setdefault((r["tokens"], r["kernel"], r["accept"]), []).append(r)
    return dict(sorted(series.items()))


def _color(index: int) -> str:
    """The index-th color of matplotlib's default cycle (the same kernel or window T in every plot)."""
    return f"C{index % 10}"


def plot_speedup(result: Row, shape: str) -> Any | None:
    """Speedup over the baseline vs batch: decode kernels (and FLA); replay verify over snapshot verify per T."""
    decode = _rows(result, "decode", shape)
    verify = _rows(result, "verify", shape, kernel="replay_verify")
    if not decode:
        return None
    figure, axes = _panels(1 + bool(verify), _title(result, shape, "speedup over the baseline"))
    ax = axes[0]
    for index, (label, rows) in enumerate(_decode_series(decode, _tuned(result)).items()):
        if label != "baseline":
            ax.plot([r["batch"] for r in rows], [r["speedup"] for r in rows], marker="o", color=_color(index), label=label)
    ax.axhline(1.0, color="gray", linewidth=1, label="baseline decode")
    ax.set_title("decode")
    ax.set_ylabel("speedup (baseline time / time)")
    _log2_axis(ax, (r["batch"] for r in decode), "batch")
    ax.legend(fontsize=8)
    if verify:
        ax = axes[1]
        tokens = sorted({r["tokens"] for r in verify})
        for (t, _, accept), rows in _verify_series(verify, ("replay_verify",)).items():
            style = {"all": "-", "staggered": ":"}.get(accept, "--")
            ax.plot([r["batch"] for r in rows], [1 / r["vs_baseline_verify"] for r in rows], style, marker="o",
                    color=_color(tokens.index(t)), label=f"T={t}, {ACCEPT_LABELS.get(accept, accept)}")
        ax.axhline(1.0, color="gray", linewidth=1, label="snapshot verify")
        ax.set_title("replay verify + commit vs per-draft snapshots")
        ax.set_ylabel("speedup")
        _log2_axis(ax, (r["batch"] for r in verify), "batch")
        ax.legend(fontsize=8)
    return figure


def plot_capacity(result: Row, shape: str) -> Any | None:
    """Replay decode time per step vs buffer capacity L, per batch: measured (p20-p80 bars), traffic model, baseline."""
    sweep = _rows(result, "capacity_sweep", shape)
    if not sweep:
        return None
    batches = sorted({r["batch"] for r in sweep})
    figure, axes = _panels(len(batches), _title(result, shape, "replay decode (output-only, flush every L) vs buffer capacity L"))
    for ax, batch in zip(axes, batches):
        rows = sorted((r for r in sweep if r["batch"] == batch), key=lambda r: r["capacity"])
        capacities = [r["capacity"] for r in rows]
        ax.errorbar(capacities, [_median(r) for r in rows], yerr=_spread(rows), marker="o", capsize=3, label="replay, measured")
        ax.plot(capacities, [r["model_ms"] for r in rows], "--", marker="x", color="C0", alpha=0.6, label="replay, traffic model")
        ax.axhline(rows[0]["baseline_ms"], color="gray", label="baseline, measured")
        ax.axhline(rows[0]["baseline_model_ms"], color="gray", linestyle=":", label="baseline, traffic model")
        ax.set_title(f"batch {batch}")
        ax.set_ylabel("ms per step (one layer)")
        ax.set_ylim(bottom=0)
        _log2_axis(ax, capacities, "buffer capacity L")
        ax.legend(fontsize=8)
    return figure


def plot_verify_cost(result: Row, shape: str) -> Any | None:
    """Verify step cost vs window T, in baseline decode steps at the same batch, per batch."""
    verify = _rows(result, "verify", shape)
    if not verify:
        return None
    batches = sorted({r["batch"] for r in verify})
    figure, axes = _panels(len(batches), _title(result, shape, "verify step cost vs window T (1 = one baseline decode step)"))
    labels = {("baseline_verify", "all"): "snapshot verify"} | {("replay_verify", a): f"replay verify, {text}" for a, text in ACCEPT_LABELS.items()}
    for ax, batch in zip(axes, batches):
        rows = [r for r in verify if r["batch"] == batch]
        tokens = sorted({r["tokens"] for r in rows})
        ax.plot(tokens, tokens, color="lightgray", linestyle=":", label="T baseline decode steps")
        for (kernel, accept), label in labels.items():
            series = sorted((r for r in rows if (r["kernel"], r["accept"]) == (kernel, accept)), key=lambda r: r["tokens"])
            if series:
                ax.plot([r["tokens"] for r in series], [r["vs_decode"] for r in series], marker="o", label=label)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("window T")
        ax.set_xticks(tokens)
        ax.set_ylabel("time / baseline decode step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    return figure


def plot_roofline(result: Row, shape: str) -> Any | None:
    """Achieved fraction of the measured copy bandwidth on the traffic model's bytes, vs batch."""
    decode = _rows(result, "decode", shape)
    verify = _rows(result, "verify", shape, accept="all")
    if not decode:
        return None
    figure, axes = _panels(1 + bool(verify), _title(result, shape, "fraction of the measured copy bandwidth (traffic-model bytes)"))
    ax = axes[0]
    for index, (label, rows) in enumerate(_decode_series(decode, _tuned(result)).items()):
        ax.plot([r["batch"] for r in rows], [100 * r["bandwidth_fraction"] for r in rows], marker="o", color=_color(index), label=label)
    ax.set_title("decode")
    if verify:
        tokens = sorted({r["tokens"] for r in verify})
        for (t, kernel, _), rows in _verify_series(verify, ("replay_verify", "baseline_verify")).items():
            style = "-" if kernel == "replay_verify" else "--"
            axes[1].plot([r["batch"] for r in rows], [100 * r["bandwidth_fraction"] for r in rows], style, marker="o",
                         color=_color(tokens.index(t)), label=f"T={t} {kernel.replace('_', ' ')}")
        axes[1].set_title("verify (all accepted)")
    for ax, rows in zip(axes, (decode, verify)):
        ax.axhline(100, color="gray", linewidth=1)
        ax.set_ylabel("% of copy bandwidth")
        ax.set_ylim(bottom=0)
        _log2_axis(ax, (r["batch"] for r in rows), "batch")
        ax.legend(fontsize=8)
    return figure


PLOTS: dict[str, Callable[[Row, str], Any | None]] = {
    "speedup": plot_speedup,
    "capacity": plot_capacity,
    "verify": plot_verify_cost,
    "roofline": plot_roofline,
}
