"""Draw the main comparisons of bench/results/*.json as PNGs for docs/benchmarks.md.

    python bench/plots.py      # all of them, into docs/img/bench-*.png
    pip install -e '.[bench]'  # matplotlib

`python bench/run.py` runs this after it rewrites the tables. Every value plotted is
read from a results file, and every picture names the files it shows with the date and
commit each records (bench/record.py). A missing results file skips its plot, saying
so.
"""

from __future__ import annotations

import io
import json
import statistics
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from PIL import Image  # a dependency of matplotlib

HERE = Path(__file__).parent
RESULTS = HERE / "results"
IMG = HERE.parent / "docs" / "img"
WIDTH, DPI = 7.0, 100


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    if not path.exists():
        return None
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def recorded(name: str, data: dict[str, Any], section: str = "") -> str:
    """`bench/results/NAME.json` with the date and commit it records (bench/record.py)."""
    meta = data[f"{section}_run"] if section else data  # a section's own run, never another's
    rev = meta.get("commit") or (
        f"{meta['committed_in']} (committed in)" if meta.get("committed_in") else ""
    )
    return f"bench/results/{name}.json, {meta.get('date')}, commit {rev or 'not recorded'}"


def _caption(fig: Figure, text: str) -> float:
    """`text` in small print along the bottom; the share of the figure's height it takes."""
    lines = [ln for part in text.split("\n") for ln in textwrap.wrap(part, 130)]
    fig.text(0.01, 0.02, "\n".join(lines), fontsize=7, color="0.35", va="bottom")
    return (0.1 + 0.13 * len(lines)) / fig.get_figheight()


def _save(fig: Figure, path: Path) -> Path:
    """A PNG of 8-bit colour (a third of the size of matplotlib's own, the same look)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.open(buf).convert("RGB").quantize(colors=128).save(path, optimize=True)
    return path


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _grouped_log_bars(ax: Axes, groups: list[str], series: dict[str, list[float]]) -> None:
    """Bars of each series side by side per group on a log scale; each bar after the
    first series is labelled with how many times shorter it is than the first's."""
    width = 0.8 / len(series)
    base = next(iter(series.values()))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        if i:
            labels = [_times(b / v) for b, v in zip(base, values, strict=True)]
            ax.bar_label(bars, labels, fontsize=6, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncols=len(series), loc="upper left", frameon=False)
    ax.margins(y=0.25)


def _ttft_chart(groups: list[str], series: dict[str, list[float]], title: str,
                caption: str, path: Path) -> Path:  # fmt: skip
    fig, ax = plt.subplots(figsize=(WIDTH, 4))
    _grouped_log_bars(ax, groups, series)
    ax.set_ylabel("warm TTFT, ms (log scale)")
    ax.set_title(title, fontsize=10)
    fig.subplots_adjust(bottom=0.08 + _caption(fig, caption), top=0.92)
    return _save(fig, path)


def plot_engines_hit(results: Path, out_dir: Path) -> Path | None:
    """Warm TTFT of prompts stored whole: recompute, ExampleConnector, kvflow's engines."""
    data = load(results, "engines")
    if data is None or "hit" not in data:
        return None
    ttft, whole = data["hit"]["ttft_ms"], data["hit"]["effective_gbs"]
    groups = [label for label in ttft if label in whole]  # the prompts stored whole
    order = ["no connector", "ExampleConnector", "kvflow", "kvflow layer", "kvflow cpu tier"]
    engines = [e for e in order if e in ttft[groups[0]]]
    names = {"no connector": "recompute"}
    series = {names.get(e, e): [ttft[g][e] for g in groups] for e in engines}
    title = "Warm TTFT of a stored prompt (labels: times faster than recompute)"
    caption = f"{recorded('engines', data, 'hit')}; {data.get('hit_run', {}).get('command', '')}"
    return _ttft_chart(groups, series, title, caption, out_dir / "bench-engines-hit.png")


def plot_ttft_tiers(results: Path, out_dir: Path) -> Path | None:
    """Warm TTFT by where the KV comes from (medians over the repeats), by prompt length."""
    data = load(results, "ttft-tiers")
    if data is None:
        return None

    def median_ms(source: str, n: int) -> float:
        return 1e3 * statistics.median(r[source][str(n)]["ttft_s"] for r in data["runs"])

    sources = ("recompute", "host tier", "fs", "redis")
    series = {s: [median_ms(s, n) for n in data["lengths"]] for s in sources}
    groups = [f"{n} tokens" for n in data["lengths"]]
    title = "Warm TTFT by tier (labels: times faster than recompute)"
    caption = f"{recorded('ttft-tiers', data)}; medians of {len(data['runs'])} repeats"
    return _ttft_chart(groups, series, title, caption, out_dir / "bench-ttft-tiers.png")


Row = tuple[str, str, float]  # (what it is measured against: the legend, the bar's label, ratio)


def _ratio_chart(rows: list[Row], title: str, caption: str, path: Path) -> Path:
    """Horizontal bars of ratios, one colour per legend entry, a line at 1.0."""
    fig, ax = plt.subplots(figsize=(WIDTH, 1.2 + 0.2 * len(rows)))
    colours = {g: f"C{i}" for i, g in enumerate(dict.fromkeys(g for g, _, _ in rows))}
    ys = range(len(rows))
    bars = ax.barh(ys, [r for _, _, r in rows], color=[colours[g] for g, _, _ in rows])
    box = {"facecolor": "white", "edgecolor": "none", "pad": 0.5}
    ax.bar_label(bars, [f"{r:.2f}" for _, _, r in rows], fontsize=6, padding=2, bbox=box)
    ax.set_yticks(ys, [label for _, label, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="0.2", linewidth=1, linestyle="--", zorder=0)
    ax.set_xlim(0, max(1.1, *(r for _, _, r in rows)) * 1.12)
    ax.tick_params(axis="x", labelsize=7)
    handles = [Patch(color=c, label=g) for g, c in colours.items()]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, _caption(fig, caption), 1, 1))
    return _save(fig, path)


def fs_io_ratio(case: dict[str, Any], side: str, op: str) -> float:
    """bench_fs_io.py: `side`'s `op` over plain's: of each load and the plain load next to
    it where the run paired them (since 2026-11-30), else of the medians."""
    if (r := case.get("ratios", {}).get(f"{side} {op}")) is not None:
        return float(r)
    g = case["gbs"]
    return float(g[f"{side} {op}"] / g["plain save" if op == "save" else "plain load"])


def _fs_rows(d: dict[str, Any]) -> list[Row]:
    rows = []
    for case, c in d["cases"].items():
        for op in ("save", "layer load", "file load"):
            for side, label in (("kvflow", ""), ("kvflow 1 thread", ", 1 thread")):
                rows.append(("fs / plain system calls", f"fs {op}, {case}{label}",
                             fs_io_ratio(c, side, op)))  # fmt: skip
    return rows


TRANSPORTS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "fs-io": _fs_rows,
    "zmq": lambda d: [("zmq / plain pyzmq", f"zmq {r['config']}", r["ratio"])
                      for r in d["table"]],
    "nixl": lambda d: [("nixl / raw NIXL", f"nixl {r['config']}", r["nixl_over_raw"])
                       for r in d["table"]],
    "nixl-layerwise": lambda d: [
        ("nixl / raw NIXL, layer by layer", f"nixl layerwise {r['config']}", r["nixl_over_raw"])
        for r in d["table"]],
    "tier": lambda d: [("host tier / plain copy", "host tier load, 128 MiB", d["load"]["ratio"])],
}  # fmt: skip


def plot_transports(results: Path, out_dir: Path) -> Path | None:
    """Each transport benchmark's kvflow / baseline ratio, the same transfer both sides."""
    rows, sources = [], []
    for name, to_rows in TRANSPORTS.items():
        if (data := load(results, name)) is not None:
            rows += to_rows(data)
            sources.append(recorded(name, data))
    if not rows:
        return None
    title = "kvflow / its baseline, the same transfer (1.0: as fast; above: faster)"
    return _ratio_chart(rows, title, "; ".join(sources), out_dir / "bench-transports.png")


def plot_convert(results: Path, out_dir: Path) -> Path | None:
    """Loads and P/D pulls that convert (TP size, layout, block size) / the same unconverted."""
    rows: list[Row] = []
    sources = []
    if (data := load(results, "convert")) is not None:
        rows += [(f"{r['transport']} P/D pull", f"{r['transport']} {r['case']}", r["ratio"])
                 for r in data["rows"]]  # fmt: skip
        sources.append(recorded("convert", data))
    if (data := load(results, "reshape")) is not None:
        rows += [("fs load", f"fs {r['kind']}, {r['direction']}", r["ratio"])
                 for r in data["rows"]]  # fmt: skip
        sources.append(recorded("reshape", data))
    if not rows:
        return None
    title = "Converted / unconverted throughput (1.0: converting costs nothing)"
    return _ratio_chart(rows, title, "; ".join(sources), out_dir / "bench-convert.png")


def plot_pd_serve(results: Path, out_dir: Path) -> Path | None:
    """Median TTFT and latency per request: one server, kvflow's P/D, vLLM's NixlConnector."""
    data = load(results, "pd-serve")
    if data is None:
        return None
    ran = {n: c for n, c in data["configs"].items() if "skipped" not in c}
    series = {
        name: [1e3 * c["ttft_s"]["median"], 1e3 * c["latency_s"]["median"]]
        for name, c in ran.items()
    }
    fig, ax = plt.subplots(figsize=(WIDTH, 4))
    _grouped_log_bars(ax, ["TTFT", "latency"], series)
    ax.set_ylabel("median per request, ms (log scale)")
    ax.set_title(f"P/D serving (labels: {next(iter(series))} / each)", fontsize=10)
    caption = (
        f"{recorded('pd-serve', data)}; {data['requests']} prompts of {data['prompt_tokens']} "
        f"tokens, {data['concurrency']} in flight; {data['command']}"
    )
    fig.subplots_adjust(bottom=0.08 + _caption(fig, caption), top=0.92)
    return _save(fig, out_dir / "bench-pd-serve.png")


def plot_pd_stream(results: Path, out_dir: Path) -> Path | None:
    """Median TTFT by prompt length: pull after prefill and streamed, per transport."""
    data = load(results, "pd-stream")
    if data is None:
        return None
    groups = [f"{t}, {size}" for t, by in data["figures"].items() for size in by]
    modes = ("pull after prefill", "streamed")
    series = {
        m: [1e3 * f["median_ttft_s"][m] for by in data["figures"].values() for f in by.values()]
        for m in modes
    }
    fig, ax = plt.subplots(figsize=(WIDTH, 4))
    _grouped_log_bars(ax, groups, series)
    ax.set_ylabel("median TTFT, ms (log scale)")
    ax.set_title("Streamed P/D by transport and prompt tokens (labels: pull after / streamed)",
                 fontsize=10)  # fmt: skip
    caption = f"{recorded('pd-stream', data)}; one request at a time; {data['command']}"
    fig.subplots_adjust(bottom=0.08 + _caption(fig, caption), top=0.92)
    return _save(fig, out_dir / "bench-pd-stream.png")


def _scale_plot(
    name: str,
    data: dict[str, Any],
    lines: dict[str, tuple[list[float], list[float], str]],
    xlabel: str,
    ylabel: str,
    title: str,
    out: Path,
) -> Path:
    """Lines (label: x, y, style) of a cost against a size, log-log, captioned."""
    fig, ax = plt.subplots(figsize=(WIDTH, 4))
    for label, (xs, ys, style) in lines.items():
        ax.plot(xs, ys, style, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    caption = f"{recorded(name, data)}; {data['command']}"
    fig.subplots_adjust(bottom=0.12 + _caption(fig, caption), top=0.92)
    return _save(fig, out)


def plot_sched_scale(results: Path, out_dir: Path) -> Path | None:
    """Each scheduler-side call's median against the requests held, log-log."""
    data = load(results, "sched-scale")
    if data is None:
        return None
    rows = data["rows"]
    sizes = [r["requests"] for r in rows]
    lines = {
        call: (sizes, [r["calls"][call]["median_us"] for r in rows], "-")
        for call in rows[0]["calls"]
    }
    return _scale_plot(
        "sched-scale", data, lines, "requests held at once (log scale)",
        "median per call, µs (log scale)",
        "kvflow's scheduler side in vLLM's Scheduler, by requests held",
        out_dir / "bench-sched-scale.png",
    )  # fmt: skip


def plot_tier_scale(results: Path, out_dir: Path) -> Path | None:
    """Each host-tier operation's median against the cache's slots, log-log, per policy."""
    data = load(results, "tier-scale")
    if data is None:
        return None
    lines = {}
    for policy, style in (("s3fifo", "-"), ("lru", "--")):
        rows = [r for r in data["rows"] if r["policy"] == policy]
        for op in rows[0]["median_ns"]:
            xs = [r["slots"] for r in rows]
            lines[f"{policy} {op}"] = (xs, [r["median_ns"][op] for r in rows], style)
    return _scale_plot(
        "tier-scale", data, lines, "slots (log scale)", "median per operation, ns (log scale)",
        "The host tier's bookkeeping by its size", out_dir / "bench-tier-scale.png",
    )  # fmt: skip


def plot_fs_scale(results: Path, out_dir: Path) -> Path | None:
    """`fs`'s per-operation medians, and its eviction step, against the files it holds."""
    data = load(results, "fs-scale")
    if data is None:
        return None
    rows = data["rows"]
    xs = [r["files"] for r in rows]
    lines = {
        op: (xs, [r[op]["p50_ms"] for r in rows], "-")
        for op in ("lookup_hit", "lookup_miss", "save", "load", "load_while_evicting")
    }
    lines["eviction step (whole)"] = (xs, [1e3 * r["evict_s"] for r in rows], "--")
    lines["open"] = (xs, [r["open_ms"] for r in rows], ":")
    return _scale_plot(
        "fs-scale", data, lines, "chunk files in the store (log scale)",
        "median, ms (log scale)", "`fs` by the files its store holds",
        out_dir / "bench-fs-scale.png",
    )  # fmt: skip


def plot_pd_scale(results: Path, out_dir: Path) -> Path | None:
    """A producer's offer, one renewal and a round of all, against the offers held."""
    data = load(results, "pd-scale")
    if data is None:
        return None
    rows = data["rows"]
    xs = [r["offers"] for r in rows]
    lines = {
        "offer (each)": (xs, [r["offer_us"] / 1e3 for r in rows], "-"),
        "renew one (p50)": (xs, [r["renew_one_ms"]["p50"] for r in rows], "-"),
        "renew all (a round)": (xs, [r["renew_all_ms"] for r in rows], "--"),
    }
    return _scale_plot(
        "pd-scale", data, lines, "offers held (log scale)", "ms (log scale)",
        "P/D offers by how many a producer holds", out_dir / "bench-pd-scale.png",
    )  # fmt: skip


def plot_route(results: Path, out_dir: Path) -> Path | None:
    """TTFT p50 and p90 by routing policy, two servers, multi-turn conversations."""
    data = load(results, "route")
    if data is None:
        return None
    series = {
        f"{name} ({p['cached_share']:.2f})": [p["ttft_p50_ms"], p["ttft_p90_ms"]]
        for name, p in data["policies"].items()
    }
    fig, ax = plt.subplots(figsize=(WIDTH, 4))
    _grouped_log_bars(ax, ["TTFT p50", "TTFT p90"], series)
    ax.set_ylabel("client TTFT, ms (log scale)")
    ax.set_title(
        f"Routing over two servers (labels: {next(iter(series)).split(' ')[0]} / each)",
        fontsize=10,
    )
    caption = (
        f"{recorded('route', data)}; {data['users']} conversations of {data['turns']} turns, "
        f"{data['concurrency']} at once, {data['rounds']} rounds; (n): the share of prompt "
        f"tokens the servers served from cache; {data['command']}"
    )
    fig.subplots_adjust(bottom=0.08 + _caption(fig, caption), top=0.92)
    return _save(fig, out_dir / "bench-route.png")


PLOTS: dict[str, Callable[[Path, Path], Path | None]] = {
    "engines-hit": plot_engines_hit,
    "ttft-tiers": plot_ttft_tiers,
    "transports": plot_transports,
    "convert": plot_convert,
    "pd-serve": plot_pd_serve,
    "pd-stream": plot_pd_stream,
    "sched-scale": plot_sched_scale,
    "tier-scale": plot_tier_scale,
    "fs-scale": plot_fs_scale,
    "pd-scale": plot_pd_scale,
    "route": plot_route,
}


def draw_all(results: Path = RESULTS, out_dir: Path = IMG) -> list[Path]:
    """Every plot whose results exist, into `out_dir`; prints a line per plot."""
    drawn = []
    for name, plot in PLOTS.items():
        path = plot(results, out_dir)
        if path is None:
            print(f"  plot {name}: its results file is not in {results}; not drawn")
            continue
        print(f"  plot {name}: {path} ({path.stat().st_size // 1024} KiB)")
        drawn.append(path)
    return drawn


if __name__ == "__main__":
    draw_all()
