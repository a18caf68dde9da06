"""The paper's claims judged from training runs' metrics.jsonl (any runs with these settings:
`bapo demo`'s, or your own `bapo train` runs read back with bapo.analysis.runs.find_runs).

Each claim is a `ClaimSpec` (bapo.analysis.claims): an effect per seed (positive = the way the
paper claims), paired by seed where two runs are compared, judged over seeds (95% Student-t
interval). The ids follow `bapo lab`'s (1-..., 2-..., 3-..., 4-...) so the two tables read side by
side; "0-..." is the precondition that on-policy RL improves on the start policy at all, and
"5-..." judges BAPO's peers (M2PO, decoupled PPO, ...) against GRPO as claim 4 judges BAPO.
Measures (RUN_MEASURES, all from metrics.jsonl rows):
  entropy          mean of the last 20% of rows (per-token entropy of the sampled batch)
  entropy fall     entropy of the first 10% of rows minus that tail mean
  grad max/median  max over updates of grad_norm / the run's median grad_norm (spikes)
  positive share   mean over all updates (first share: over the first 10% of rows)
  held-out         heldout/avg@k of the last row that has it (the final policy)
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable

from bapo.analysis.claims import Arm, Claim, ClaimSpec, SeedValues, evaluate_claims, format_mean
from bapo.analysis.runs import Run, group_runs

WHERE = "tiny LLM, countdown task"


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


def run_measures(target: float) -> dict[str, Callable[[Run], float]]:
    """Measure name -> one run's value; `target` is bapo's positive-share target."""
    return {
        "entropy": lambda run: run.tail_mean("entropy"),
        "entropy fall": entropy_fall,
        "grad max/median": grad_spike,
        "held-out": final_accuracy,
        "held-out at the start": start_accuracy,
        "held-out gain": lambda run: final_accuracy(run) - start_accuracy(run),
        "positive share": lambda run: run.mean("positive_share"),
        "first positive share": lambda run: run.head_mean("positive_share"),
        "share distance": lambda run: abs(run.mean("positive_share") - target),
        # the entropy split by token kind (bapo.core.token_kind_sums): digits vs the other tokens
        "entropy of digits": lambda run: run.tail_mean("entropy/digit"),
        "entropy of other tokens": lambda run: run.tail_mean("entropy/other"),
    }


def run_values(runs: list[Run], measures: dict[str, Callable[[Run], float]]) -> SeedValues:
    """The loader for metrics.jsonl runs: per arm (method, setting) and measure, {seed: value}."""
    groups = group_runs(runs)

    def values(arm: Arm, metric: str) -> dict[int, float] | None:
        members = groups.get(arm.setting, {}).get(arm.method)
        return {run.seed: measures[metric](run) for run in members} if members else None

    return values


def _e(setting: str) -> int | None:
    """E of a pure staleness-E setting ("E=2"); None for delay / partial-rollout settings."""
    match = re.fullmatch(r"E=(\d+)", setting)
    return int(match.group(1)) if match else None


def _peer_claims(setting: str, methods: list[str], peers: tuple[str, ...], where: str, grpo: Arm) -> list[ClaimSpec]:
    """5. the peers against the same GRPO runs, on the same footing as BAPO's claim 4."""
    return [
        ClaimSpec(
            f"5-heldout-{peer}@{setting}",
            "the method named in the id (a peer of BAPO) beats GRPO on held-out accuracy",
            where,
            "held-out",
            Arm(peer, setting),
            grpo,
            detail=f"avg@k {peer} {{treatment}} vs GRPO {{baseline}}",
        )
        for peer in peers
        if peer in methods
    ]


def run_claim_specs(
    settings: dict[str, list[str]],
    target: float,
    k: int | str = "k",
    treatments: tuple[str, ...] = ("bapo",),
    where_prefix: str = WHERE,
    token_kinds: bool = False,
    peers: tuple[str, ...] = (),
) -> list[ClaimSpec]:
    """Every claim of the runs' settings ({setting: methods present}), claims 0-5 in order;
    k: the held-out samples per prompt (avg@k in claim 0's text); treatments: the methods that
    claim 4 compares with GRPO (ids 4-<what>-<setting> for "bapo", 4-<what>-<method>@<setting>
    for another, e.g. bapo-paper); where_prefix: the model and task named in each claim's "where";
    token_kinds: claim 4's entropy also on digit tokens and on the others (entropy/digit, entropy/other);
    peers: the methods judged against GRPO on held-out accuracy alone (5-heldout-<method>@<setting>),
    the question a user comparing BAPO with its peers asks of each."""
    base = Arm("grpo", "E=0")
    has_base = "grpo" in settings.get("E=0", ())
    specs: list[ClaimSpec] = []
    if has_base:  # 0. precondition: on-policy RL improves held-out accuracy over the start policy
        specs.append(
            ClaimSpec(
                "0-rl-improves",
                f"on-policy GRPO raises held-out avg@{k} over the start policy",
                f"{where_prefix}, E=0",
                "held-out gain",
                base,
                detail=f"avg@{k} start {{start}} -> {{final}}",
                shows=(("start", base, "held-out at the start"), ("final", base, "held-out")),
            )
        )
    for e, setting in sorted((e, s) for s in settings if (e := _e(s)) is not None):
        if not e or not has_base:
            continue  # 1. growing E: GRPO's entropy falls faster; held-out lower; gradient norm less steady
        stale, where = Arm("grpo", setting), f"{where_prefix}, equal samples, E=0 vs E={e}"
        specs += [
            ClaimSpec(
                f"1-entropy-E{e}-samples",
                "GRPO entropy falls faster as staleness E grows",
                where,
                "entropy fall",
                stale,
                base,
                detail=f"entropy fall E={e} {{treatment}} vs E=0 {{baseline}}",
            ),
            ClaimSpec(
                f"1-heldout-E{e}-samples",
                "GRPO held-out accuracy is lower as staleness E grows",
                where,
                "held-out",
                stale,
                base,
                sign=-1,
                detail=f"avg@k E=0 {{baseline}} vs E={e} {{treatment}}",
            ),
            ClaimSpec(
                f"1-gradnorm-unstable-E{e}-samples",
                "GRPO grad norm less steady as E grows (max / median)",
                where,
                "grad max/median",
                stale,
                base,
                detail=f"max/median E={e} {{treatment}} vs E=0 {{baseline}}",
            ),
        ]
    for setting, methods in settings.items():
        if "grpo" not in methods:
            continue
        grpo, bapo, where = Arm("grpo", setting), Arm("bapo", setting), f"{where_prefix}, {setting}"
        if _e(setting) == 0:  # on-policy: only methods with their own E=0 runs (claim 5) differ from grpo
            specs += _peer_claims(setting, methods, peers, where, grpo)
            continue
        # 2. raising c_high (clip-higher: 1.28 vs grpo's 1.2) slows the entropy fall
        specs.append(
            ClaimSpec(
                f"2-c_high-{setting}",
                "raising c_high slows the entropy fall (clip-higher vs grpo)",
                where,
                "entropy",
                Arm("clip-higher", setting),
                grpo,
                detail="entropy clip-higher {treatment} vs grpo {baseline}",
            )
        )
        # 4. BAPO: share nearer its target, more entropy, better held-out accuracy than GRPO
        for method in treatments:
            if method not in methods:
                continue
            bapo, tag = Arm(method, setting), setting if method == "bapo" else f"{method}@{setting}"
            name = "BAPO" if method == "bapo" else method
            specs += [
                ClaimSpec(
                    f"4-share-{tag}",
                    f"BAPO holds the positive share nearer its target {target} than GRPO",
                    where,
                    "share distance",
                    bapo,
                    grpo,
                    sign=-1,
                    detail=f"share {name} {{bapo}} vs GRPO {{grpo}}",
                    shows=(("bapo", bapo, "positive share"), ("grpo", grpo, "positive share")),
                ),
                ClaimSpec(
                    f"4-entropy-{tag}",
                    "BAPO keeps more entropy than GRPO",
                    where,
                    "entropy",
                    bapo,
                    grpo,
                    detail=f"entropy {name} {{treatment}} vs GRPO {{baseline}}",
                ),
                *(
                    ClaimSpec(
                        f"4-entropy-{kind}-{tag}",
                        f"BAPO keeps more entropy than GRPO on {measure.removeprefix('entropy of ')}",
                        where,
                        measure,
                        bapo,
                        grpo,
                        detail=f"entropy {name} {{treatment}} vs GRPO {{baseline}}",
                    )
                    for kind, measure in (("digit", "entropy of digits"), ("other", "entropy of other tokens"))
                    if token_kinds
                ),
                ClaimSpec(
                    f"4-heldout-{tag}",
                    "BAPO beats GRPO on held-out accuracy",
                    where,
                    "held-out",
                    bapo,
                    grpo,
                    detail=f"avg@k {name} {{treatment}} vs GRPO {{baseline}}",
                ),
            ]
        specs += _peer_claims(setting, methods, peers, where, grpo)
    if has_base:  # 3. negative tokens dominate the loss early (positive share < 0.5 on the first updates)
        specs.append(
            ClaimSpec(
                "3-negative-dominate",
                "negative tokens dominate the loss early (positive share < 0.5)",
                f"{where_prefix}, first 10% of updates, on-policy GRPO",
                "first positive share",
                base,
                sign=-1,
                reference=0.5,
                detail="share {treatment}",
            )
        )
    order = {c: i for i, c in enumerate("012345")}
    return sorted(specs, key=lambda spec: order.get(spec.id[0], 9))


def run_claims(
    runs: list[Run],
    target: float,
    treatments: tuple[str, ...] = ("bapo",),
    where: str = WHERE,
    token_kinds: bool = False,
    peers: tuple[str, ...] = (),
) -> list[Claim]:
    """Every claim whose runs are present; `target` is bapo's positive-share target; treatments,
    where, token_kinds and peers: as run_claim_specs."""
    groups = group_runs(runs)
    base = groups.get("E=0", {}).get("grpo")
    k = base[0].final.get("k", "k") if base else "k"
    settings = {setting: list(methods) for setting, methods in groups.items()}
    specs = run_claim_specs(settings, target, k, treatments, where, token_kinds, peers)
    return evaluate_claims(specs, run_values(runs, run_measures(target)), fmt=format_mean)
