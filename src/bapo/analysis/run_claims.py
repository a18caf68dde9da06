"""The paper's claims judged from training runs' metrics.jsonl (any runs with these settings:
`bapo demo`'s, or your own `bapo train` runs read back with bapo.analysis.runs.find_runs).

Each claim is an effect per seed (positive = the way the paper claims), paired by seed where two
runs are compared, judged by bapo.analysis.claims (95% Student-t interval over seeds). The ids
follow `bapo lab`'s (1-..., 2-..., 3-..., 4-...) so the two tables read side by side; "0-..." is
the precondition that on-policy RL improves on the start policy at all.
Definitions (all from metrics.jsonl rows):
  entropy          mean of the last 20% of rows (per-token entropy of the sampled batch)
  entropy fall     entropy of the first 10% of rows minus that tail mean
  grad max/median  max over updates of grad_norm / the run's median grad_norm (spikes)
  positive share   mean over all updates
  held-out         heldout/avg@k of the last row that has it (the final policy)
"""

from __future__ import annotations

import math
import re
import statistics

from bapo.analysis.claims import Claim
from bapo.analysis.runs import Run, group_runs


def grad_spike(run: Run) -> float:
    """max / median of grad_norm over the run's updates (1 = perfectly steady)."""
    norms = [v for v in run.values("grad_norm") if v > 0]
    return max(norms) / statistics.median(norms) if norms else math.nan


def entropy_fall(run: Run) -> float:
    return run.head_mean("entropy") - run.tail_mean("entropy")


def final_accuracy(run: Run) -> float:
    final = run.final
    return final.get(f"avg@{final['k']}", math.nan) if final else math.nan


def start_accuracy(run: Run) -> float:
    start = run.heldout("heldout/start/")
    return start.get(f"avg@{start['k']}", math.nan) if start else math.nan


def _fmt(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    return f"{statistics.fmean(finite):.3f}" if finite else "nan"


def _paired(a: list[Run], b: list[Run], fn) -> tuple[list[float], list[float], list[float]]:
    """(fn(a), fn(b), fn(a) - fn(b)) over the seeds both lists have."""
    by_seed = {r.seed: r for r in b}
    pairs = [(fn(r), fn(by_seed[r.seed])) for r in a if r.seed in by_seed]
    return [p[0] for p in pairs], [p[1] for p in pairs], [p[0] - p[1] for p in pairs]


def _e(setting: str) -> int | None:
    """E of a pure staleness-E setting ("E=2"); None for delay / partial-rollout settings."""
    match = re.fullmatch(r"E=(\d+)", setting)
    return int(match.group(1)) if match else None


def run_claims(runs: list[Run], target: float) -> list[Claim]:
    """Every claim whose runs are present; `target` is bapo's positive-share target."""
    groups = group_runs(runs)
    claims: list[Claim] = []
    e_settings = sorted((e, s) for s in groups if (e := _e(s)) is not None)
    base = groups.get("E=0", {}).get("grpo")
    where = "tiny LLM, countdown task"

    # 0. precondition: on-policy RL improves held-out accuracy over the start policy
    if base:
        final, start = [final_accuracy(r) for r in base], [start_accuracy(r) for r in base]
        diff = [f - s for f, s in zip(final, start)]
        k = base[0].final.get("k", "k")
        claims.append(
            Claim.from_effects(
                "0-rl-improves",
                f"on-policy GRPO raises held-out avg@{k} over the start policy",
                f"{where}, E=0",
                diff,
                f"avg@{k} start {_fmt(start)} -> {_fmt(final)}",
            )
        )

    # 1. growing E: GRPO's entropy falls faster; gradient norm less steady
    for e, setting in e_settings:
        stale = groups[setting].get("grpo")
        if not e or not base or not stale:
            continue
        a, b, d = _paired(stale, base, entropy_fall)
        claims.append(
            Claim.from_effects(
                f"1-entropy-E{e}-samples",
                "GRPO entropy falls faster as staleness E grows",
                f"{where}, equal samples, E=0 vs E={e}",
                d,
                f"entropy fall E={e} {_fmt(a)} vs E=0 {_fmt(b)}",
            )
        )
        a, b, d = _paired(base, stale, final_accuracy)
        claims.append(
            Claim.from_effects(
                f"1-heldout-E{e}-samples",
                "GRPO held-out accuracy is lower as staleness E grows",
                f"{where}, equal samples, E=0 vs E={e}",
                d,
                f"avg@k E=0 {_fmt(a)} vs E={e} {_fmt(b)}",
            )
        )
        a, b, d = _paired(stale, base, grad_spike)
        claims.append(
            Claim.from_effects(
                f"1-gradnorm-unstable-E{e}-samples",
                "GRPO grad norm less steady as E grows (max / median)",
                f"{where}, equal samples, E=0 vs E={e}",
                d,
                f"max/median E={e} {_fmt(a)} vs E=0 {_fmt(b)}",
            )
        )

    for setting, by_method in groups.items():
        e = _e(setting)
        grpo = by_method.get("grpo")
        if not grpo or e == 0:
            continue
        # 2. raising c_high (clip-higher: 1.28 vs grpo's 1.2) slows the entropy fall
        if "clip-higher" in by_method:
            a, b, d = _paired(by_method["clip-higher"], grpo, lambda r: r.tail_mean("entropy"))
            claims.append(
                Claim.from_effects(
                    f"2-c_high-{setting}",
                    "raising c_high slows the entropy fall (clip-higher vs grpo)",
                    f"{where}, {setting}",
                    d,
                    f"entropy clip-higher {_fmt(a)} vs grpo {_fmt(b)}",
                )
            )
        # 4. BAPO: share nearer its target, more entropy, better held-out accuracy than GRPO
        if "bapo" in by_method:
            bapo = by_method["bapo"]
            a, b, d = _paired(grpo, bapo, lambda r: abs(r.mean("positive_share") - target))
            claims.append(
                Claim.from_effects(
                    f"4-share-{setting}",
                    f"BAPO holds the positive share nearer its target {target} than GRPO",
                    f"{where}, {setting}",
                    d,
                    f"share BAPO {_fmt([r.mean('positive_share') for r in bapo])} vs GRPO "
                    f"{_fmt([r.mean('positive_share') for r in grpo])}",
                )
            )
            a, b, d = _paired(bapo, grpo, lambda r: r.tail_mean("entropy"))
            claims.append(
                Claim.from_effects(
                    f"4-entropy-{setting}",
                    "BAPO keeps more entropy than GRPO",
                    f"{where}, {setting}",
                    d,
                    f"entropy BAPO {_fmt(a)} vs GRPO {_fmt(b)}",
                )
            )
            a, b, d = _paired(bapo, grpo, final_accuracy)
            claims.append(
                Claim.from_effects(
                    f"4-heldout-{setting}",
                    "BAPO beats GRPO on held-out accuracy",
                    f"{where}, {setting}",
                    d,
                    f"avg@k BAPO {_fmt(a)} vs GRPO {_fmt(b)}",
                )
            )

    # 3. negative tokens dominate the loss early (positive share < 0.5 on the first updates)
    if base:
        share = [r.head_mean("positive_share") for r in base]
        claims.append(
            Claim.from_effects(
                "3-negative-dominate",
                "negative tokens dominate the loss early (positive share < 0.5)",
                f"{where}, first 10% of updates, on-policy GRPO",
                [0.5 - s for s in share],
                f"share {_fmt(share)}",
            )
        )
    order = {c: i for i, c in enumerate("01234")}
    return sorted(claims, key=lambda c: order.get(c.id[0], 9))
