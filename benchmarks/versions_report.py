"""bench_versions' tables, bars and Markdown: the per-pass ratios of the two versions, phase by
phase (see bench_versions.py for the phases and the method)."""

from __future__ import annotations

from typing import Any

from common import fmt, median, spread, table

SAME_TREE = ("ledger", "ledger-0")  # the working tree without and with a ledger
SPEED_BAR, RSS_BAR = 0.97, 1.1
BARS = {"ledger": 0.99, "ledger-0": 0.99}  # the ledger may cost 1% of the raw-read route

Runs = dict[tuple[str, str], list[dict[str, Any]]]


def _pairs(runs: Runs, phase: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return list(zip(runs.get((phase, "before"), []), runs.get((phase, "after"), [])))


def cpu_ratios(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[float]:
    """CPU seconds per sample, the ref's over the tree's, pass by pass (a pass's counts may
    differ a little)."""
    return [(b["cpu_seconds"] / b["samples"]) / (a["cpu_seconds"] / a["samples"])
            for b, a in pairs if a.get("cpu_seconds") and b.get("cpu_seconds")]


def _range(xs: list[float]) -> str:
    lo_hi = spread(xs)
    return "-" if lo_hi is None else f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}"


def _ledger_bars(phase: str, runs: Runs, cpu: float | None, speed: float | None,
                 ratios: list[float], cpus: list[float], cpu_rows: list[str]) -> dict[str, Any]:
    """The ledger's cost: CPU seconds per sample, and its share of the pass's CPU seconds."""
    cpu_rows.append(f"{phase}: CPU-time ratio {fmt(cpu, 4)} (per pass "
                    f"{' '.join(f'{r:.3f}' for r in cpus)}); wall-time ratio "
                    f"{fmt(speed, 4)} (per pass {' '.join(f'{r:.3f}' for r in ratios)})")
    shares = {k: [r[f"{k}_cpu_seconds"] / r["cpu_seconds"] for r in runs.get((phase, v), [])
                  if f"{k}_cpu_seconds" in r]
              for k, v in (("ledger", "after"), ("io", "before"))}
    share = {k: median(v) for k, v in shares.items()}
    for k, v in shares.items():
        if v:
            cpu_rows.append(f"{phase}: {k} share of the pass's CPU seconds, median "
                            f"{100 * (share[k] or 0):.3f}% (per pass "
                            f"{' '.join(f'{100 * x:.3f}' for x in v)})")
    return {"ledger_share": share["ledger"], "io_share": share["io"],
            "ledger_pass_shares": shares["ledger"], "io_pass_shares": shares["io"]}


def _met(phase: str, held: float | None, mem: float | None, extra: dict[str, Any]) -> bool:
    bar = BARS.get(phase, SPEED_BAR)
    ok = held is not None and mem is not None and held >= bar and mem <= RSS_BAR
    share = extra.get("ledger_share")
    return ok or (share is not None and share <= 1 - bar and mem is not None and mem <= RSS_BAR)


def phase_report(phase: str, runs: Runs, bar_on: str, out: dict[str, Any]) -> None:
    """One phase's row of each table, its bars and its summary, added to ``out``."""
    trees = ("before", "after")
    med = {v: median(r["rate"] for r in runs.get((phase, v), [])) for v in trees}
    rss = {v: median(r["peak_rss_bytes"] for r in runs.get((phase, v), [])) for v in trees}
    pairs = _pairs(runs, phase)
    ratios = [a["rate"] / b["rate"] for b, a in pairs]
    speed = median(ratios)
    mem = median(a["peak_rss_bytes"] / b["peak_rss_bytes"] for b, a in pairs)
    bar = BARS.get(phase, SPEED_BAR)
    cpus = cpu_ratios(pairs)
    cpu = median(cpus)
    extra: dict[str, Any] = {}
    if phase in SAME_TREE:  # the bar is on CPU seconds (see bench_versions._cpu_seconds)
        extra = _ledger_bars(phase, runs, cpu, speed, ratios, cpus, out["cpu_rows"])
    else:
        out["cpu_table"].append([phase, fmt(cpu, 3), _range(cpus),
                                 " ".join(f"{r:.3f}" for r in cpus),
                                 "met" if cpu is not None and cpu >= bar else "NOT MET"])
    held_on = "cpu" if phase in SAME_TREE else bar_on
    ok = _met(phase, cpu if held_on == "cpu" else speed, mem, extra)
    out["bars"][phase] = {
        **extra, "speed_ratio": speed, "rss_ratio": mem, "met": ok, "speed_bar": bar,
        "cpu_ratio": cpu, "cpu_pass_ratios": cpus, "bar_on": held_on, "pass_ratios": ratios,
        "routes": sorted({str(r.get("route")) for r in runs.get((phase, "after"), [])})}
    out["summary"][phase] = {v: {"median_rate": med[v], "median_peak_rss_bytes": rss[v],
                                 "spread": spread(r["rate"] for r in runs.get((phase, v), []))}
                             for v in trees}
    out["rows"].append([phase, fmt(med["before"]), fmt(med["after"]), fmt(speed, 3),
                        _range(ratios), fmt((rss["before"] or 0) / 1e6),
                        fmt((rss["after"] or 0) / 1e6), fmt(mem, 3),
                        "met" if ok else "NOT MET"])


def report(phases: list[str], runs: Runs, before: str, bar_on: str) -> dict[str, Any]:
    """Every phase's rows, bars and summary, and the two tables as text."""
    out: dict[str, Any] = {"rows": [], "summary": {}, "bars": {}, "cpu_rows": [],
                           "cpu_table": []}
    for phase in phases:
        phase_report(phase, runs, bar_on, out)
    out["text"] = table(out["rows"], ["phase", f"{before} /s", "tree /s", "pass ratio",
                                      "per pass", f"{before} MB", "tree MB", "RSS ratio", "bar"])
    out["cpu_text"] = table(out["cpu_table"], [
        "phase", f"CPU ratio ({before}/tree)", "per pass", "pass ratios",
        f"bar {SPEED_BAR}"]) if out["cpu_table"] else ""
    return out


def markdown(path: str, head: dict[str, Any], out: dict[str, Any], phases: list[str]) -> None:
    """The Markdown beside the JSON: ``head`` has before, passes, command, env and bar_on."""
    env, before = head["env"], head["before"]
    git = env.get("git") or {}
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {before} against the working tree ({head['passes']} alternating passes)\n\n")
        f.write(f"`{head['command']}`, {env.get('date_utc', '?')}, working tree at "
                f"{str(git.get('revision', '?'))[:7]}{' (dirty)' if git.get('dirty') else ''}, "
                f"{env.get('cpu_count', '?')} cores, load average {head['load']}.\n\n")
        f.write("```\n" + out["text"] + "\n```\n\n")
        if out["cpu_text"]:
            f.write("CPU seconds per sample of the timed part (process and ended children), the "
                    "ref's over the tree's, per pass and their median:\n\n```\n"
                    + out["cpu_text"] + "\n```\n\n")
        f.write(f"Bar: the median of the per-pass ratios, >= {SPEED_BAR}x the "
                f"{'rate' if head['bar_on'] == 'wall' else 'CPU seconds per sample (--bar cpu)'}"
                f" and <= {RSS_BAR}x the peak RSS of the ref, in every phase; 'per pass': the "
                "lowest and highest per-pass ratio.\n")
        if any(p in SAME_TREE for p in phases):
            f.write(f"\n{', '.join(p for p in phases if p in SAME_TREE)}: both columns are the "
                    "working tree, the first without, the second with FeedLoader(ledger=DIR); "
                    f"bar: the median of the per-pass ratios of CPU seconds (without / with, "
                    f"main process and workers, the same samples) >= {BARS['ledger']}x, or the "
                    "median share of the pass's CPU seconds spent in the ledger's methods <= "
                    f"{100 * (1 - BARS['ledger']):.0f}% (measured in the pass with the ledger; "
                    "io: the share of io counting, in the pass without it):\n\n")
            f.write("".join(f"- {r}\n" for r in out["cpu_rows"]))
