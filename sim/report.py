"""Human output of a sweep: a text table, the JSON file and the PNG plot.

The table puts policies in rows and capacities in columns so that a reader compares
policies at one budget down a column, and sees what memory buys along a row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from hybridcache.sim.sizes import format_bytes


def _grid(doc: dict) -> tuple[list[str], list[int], dict[tuple[str, int], dict]]:
    results: Sequence[dict] = doc["results"]
    policies = list(dict.fromkeys(r["policy"] for r in results))
    caps = sorted({r["capacity_bytes"] for r in results})
    cells = {(r["policy"], r["capacity_bytes"]): r for r in results}
    return policies, caps, cells


def format_table(doc: dict, metric: str = "token_hit_rate") -> str:
    """A fixed-width table of ``metric`` (policy x capacity)."""
    policies, caps, cells = _grid(doc)
    width = max([len(p) for p in policies] + [6])
    head = f"{'policy':<{width}}" + "".join(f"{format_bytes(c):>10}" for c in caps)
    lines = [head, "-" * len(head)]
    for p in policies:
        row = f"{p:<{width}}"
        for c in caps:
            r = cells.get((p, c))
            row += f"{r[metric]:>10.3f}" if r is not None else f"{'-':>10}"
        lines.append(row)
    return "\n".join(lines)


def format_summary(doc: dict) -> str:
    """Header line plus the token-hit-rate and FLOPs-saved tables."""
    out = [
        f"trace {doc['trace']}: {doc['requests']} requests, {doc['prompt_tokens']:,} prompt "
        f"tokens, model {doc['model']}, hash unit {doc.get('hash_unit')}"
        + (f", {doc['skipped_lines']} bad lines skipped" if doc.get("skipped_lines") else ""),
        "",
        "token hit rate (prompt tokens served from cache / prompt tokens)",
        format_table(doc, "token_hit_rate"),
        "",
        "prefill FLOPs saved (fraction)",
        format_table(doc, "prefill_flops_saved_frac"),
    ]
    return "\n".join(out)


def write_json(doc: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def plot(doc: dict, path: str | Path, title: str | None = None) -> None:
    """Token hit rate vs capacity (log2 axis), one line per policy, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies, caps, cells = _grid(doc)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    styles = {"kv-only": dict(linestyle="--", color="0.4"), "hybridcache": dict(linewidth=2.6)}
    for p in policies:
        xs = [c / (1 << 30) for c in caps if (p, c) in cells]
        ys = [cells[(p, c)]["token_hit_rate"] for c in caps if (p, c) in cells]
        ax.plot(xs, ys, marker="o", label=p, **styles.get(p, {}))
    ax.set_xscale("log", base=2)
    ax.set_xticks([c / (1 << 30) for c in caps])
    ax.set_xticklabels([format_bytes(c) for c in caps])
    ax.set_xlabel("cache capacity")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or f"{doc['model']}: {Path(str(doc['trace'])).name}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
