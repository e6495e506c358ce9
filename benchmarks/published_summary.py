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
    """Per ``S`` layout group (one source and release, only the layout differs): the pairs of its costed rows
    whose published figures differ by more than 5%, and of those the ones the prediction orders the same way."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if str(r.get("layout_group", "")).startswith("S"):
            groups.setdefault(r["layout_group"], []).append(r)
    out = {}
    for group, members in sorted(groups.items()):
        pub, pred = "published_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu"
        pairs = [(a, b) for i, a in enumerate(members) for b in members[i + 1:] if abs(a[pub] / b[pub] - 1) > 0.05]
        agree = sum((a[pred] - b[pred]) * (a[pub] - b[pub]) > 0 for a, b in pairs)
        out[group] = {"rows": [m["row_id"] for m in members], "pairs": len(pairs), "agree": agree}
    return out


NEAR_TIE, TIE_PREDICTED = 0.05, 0.10
"""Two layouts whose published figures are within ``NEAR_TIE`` of each other are a near-tie, which the prediction
reports as one where its two figures are within ``TIE_PREDICTED`` (the dense rows' error bar)."""
_LAYOUT = ("tp", "pp", "vp", "cp", "ep", "dp", "micro_batch", "replicate")


def _near_ties(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout group (``S``: one release; ``X``: across releases, Qwen3-30B-A3B's PP 2 × EP 8 against EP 16 among
    them), each pair of two different layouts published within :data:`NEAR_TIE` of each other, with both gaps."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("layout_group"):
            groups.setdefault(r["layout_group"], []).append(r)
    pub, pred = "published_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu"
    out = []
    for group, members in sorted(groups.items()):
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if [a.get(k) for k in _LAYOUT] == [b.get(k) for k in _LAYOUT] or abs(a[pub] / b[pub] - 1) > NEAR_TIE:
                    continue
                gap = a[pred] / b[pred] - 1
                out.append({"group": group, "rows": [a["row_id"], b["row_id"]], "published_gap": a[pub] / b[pub] - 1,
                            "predicted_gap": gap, "reported_as_tie": abs(gap) <= TIE_PREDICTED})
    return out


def _stats(errors: list[float]) -> dict[str, Any]:
    errors = sorted(errors)
    return {"runs": len(errors), "median": statistics.median(errors), "p90": errors[math.ceil(0.9 * len(errors)) - 1],
            "worst": errors[-1]} if errors else {"runs": 0}


def _kind(row: dict[str, Any]) -> str:
    """``"H100 megatron-te"`` from the device the row was costed on (``"H100-80GB (megatron-te)"``)."""
    from autosplit.gpu_presets import SYSTEMS

    preset, _, engine = str(row.get("device", "")).partition(" (")
    kind = next((k for k, system in SYSTEMS.items() if system.preset == preset), preset)
    return f"{kind} {engine.rstrip(')')}"


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Errors of the costed dense rows with a published figure (over all, and per GPU kind and engine profile: what a
    plan's report quotes), the mixtures of experts' apart, ordering within each ``S`` layout group, the rows predicted
    not to fit."""
    compared = [r for r in results if r.get("ratio") is not None]
    moe = [abs(r["ratio"] - 1) for r in compared if r.get("experts")]
    rows = [r for r in compared if not r.get("experts")]  # the dense record: what the fitted figures are judged on
    errors = sorted(abs(r["ratio"] - 1) for r in rows)
    groups = _agreement(rows)
    pairs, agree = sum(g["pairs"] for g in groups.values()), sum(g["agree"] for g in groups.values())
    kinds: dict[str, list[float]] = {}
    for r in rows:
        kinds.setdefault(_kind(r), []).append(abs(r["ratio"] - 1))
    return {
        "rows": len(results), "costed": sum(r["outcome"] == "costed" for r in results), "compared": len(rows),
        "median_abs_error": statistics.median(errors) if errors else None,
        "p90_abs_error": errors[math.ceil(0.9 * len(errors)) - 1] if errors else None,  # nearest rank
        "worst_abs_error": errors[-1] if errors else None,
        "within_10pct": sum(e <= 0.10 for e in errors), "layout_groups": groups,
        "ordering_agreement": agree / pairs if pairs else None,
        "by_kind": {k: _stats(v) for k, v in sorted(kinds.items())},
        "experts": _stats(moe),  # the mixtures of experts, apart: their terms are not fitted (docs/experts.md)
        "near_ties": _near_ties(compared),
        "predicted_not_to_fit": [r["row_id"] for r in compared if r.get("fits") is False],
        "reasons": dict(Counter(r["reason"].split(":")[0] for r in results if r.get("reason")).most_common()),
    }


def print_summary(s: dict[str, Any]) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    print(f"{s['costed']} of {s['rows']} rows costed, {s['compared']} dense ones against a published figure: "
          f"median |predicted/published − 1| "
          f"{pct(s['median_abs_error'])}, 90th percentile {pct(s['p90_abs_error'])}, worst {pct(s['worst_abs_error'])}, "
          f"within 10%: {s['within_10pct']}")
    if (moe := s.get("experts", {})).get("runs"):
        print(f"  mixtures of experts, apart: median {pct(moe['median'])}, 90th percentile {pct(moe['p90'])}, worst "
              f"{pct(moe['worst'])} over {moe['runs']} runs")
    for kind, k in s["by_kind"].items():
        print(f"  {kind}: median {pct(k.get('median'))}, 90th percentile {pct(k.get('p90'))} over {k['runs']} runs")
    for group, g in s["layout_groups"].items():
        print(f"  layout group {group} (rows {', '.join(g['rows'])}): order agrees on {g['agree']} of {g['pairs']} pairs")
    print(f"ordering agreement over the S groups (pairs more than 5% apart): {pct(s['ordering_agreement'])}")
    ties = s.get("near_ties", [])
    print(f"near-ties (two layouts of a group published within {NEAR_TIE:.0%}): {len(ties)}, "
          f"predicted within {TIE_PREDICTED:.0%} for {sum(t['reported_as_tie'] for t in ties)}")
    for t in ties:
        print(f"  {t['group']} rows {' and '.join(t['rows'])}: published {t['published_gap']:+.1%}, predicted {t['predicted_gap']:+.1%}")
    print(f"predicted not to fit ({len(s['predicted_not_to_fit'])}): {', '.join(s['predicted_not_to_fit']) or 'none'}")
    for reason, n in s["reasons"].items():
        print(f"  {n:4d}  {reason}")
