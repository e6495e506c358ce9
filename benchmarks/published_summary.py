"""The summary of ``benchmarks/published.py``: errors of the costed rows against the published figures, the
order of each layout group's rows, and the reasons the others were not costed.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["print_summary", "summarize"]


def _agreement(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ``layout_group``: the pairs of its costed rows whose published figures differ, and of those the ones
    the prediction orders the same way."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("layout_group"):
            groups.setdefault(r["layout_group"], []).append(r)
    out = {}
    for group, members in sorted(groups.items()):
        pub, pred = "published_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu"
        pairs = [(a, b) for i, a in enumerate(members) for b in members[i + 1:] if a[pub] != b[pub]]
        agree = sum((a[pred] - b[pred]) * (a[pub] - b[pub]) > 0 for a, b in pairs)
        out[group] = {"rows": [m["row_id"] for m in members], "pairs": len(pairs), "agree": agree}
    return out


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Errors of the costed rows with a published figure, and ordering agreement within each layout group."""
    rows = [r for r in results if r.get("ratio") is not None]
    errors = sorted(abs(r["ratio"] - 1) for r in rows)
    groups = _agreement(rows)
    pairs, agree = sum(g["pairs"] for g in groups.values()), sum(g["agree"] for g in groups.values())
    return {
        "rows": len(results), "costed": sum(r["outcome"] == "costed" for r in results), "compared": len(rows),
        "median_abs_error": statistics.median(errors) if errors else None,
        "p90_abs_error": errors[math.ceil(0.9 * len(errors)) - 1] if errors else None,  # nearest rank
        "within_10pct": sum(e <= 0.10 for e in errors), "layout_groups": groups,
        "ordering_agreement": agree / pairs if pairs else None,
        "reasons": dict(Counter(r["reason"].split(":")[0] for r in results if r.get("reason")).most_common()),
    }


def print_summary(s: dict[str, Any]) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    print(f"{s['costed']} of {s['rows']} rows costed, {s['compared']} against a published figure: median |predicted/published − 1| "
          f"{pct(s['median_abs_error'])}, 90th percentile {pct(s['p90_abs_error'])}, within 10%: {s['within_10pct']}")
    for group, g in s["layout_groups"].items():
        print(f"  layout group {group} (rows {', '.join(g['rows'])}): order agrees on {g['agree']} of {g['pairs']} pairs")
    print(f"ordering agreement over all groups: {pct(s['ordering_agreement'])}")
    for reason, n in s["reasons"].items():
        print(f"  {n:4d}  {reason}")
