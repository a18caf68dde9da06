"""bapo.analysis: reading, summarising and reporting runs of any origin (trainer, demo, lab).

evaluate.py avg@k / pass@k with batched HF generate (`bapo eval`)
runs.py     reading runs back from metrics.jsonl (identity, final eval; lab cells one run per seed;
            old metric names read as today's)
plots.py    PNGs from metrics.jsonl (`bapo plot`, the demo's and the lab's reports)
report.py   report.md and the comparison table (`bapo compare`)
claims.py   the one claims engine: claims as data (ClaimSpec), judged over seeds (effect, 95%
            interval, verdict), the leaderboard of methods x settings; table and JSON
run_claims.py  the paper's claims as ClaimSpecs over metrics.jsonl runs (`bapo demo`, `bapo compare --claims`)
"""

from bapo.analysis.claims import (
    Arm,
    Claim,
    ClaimSpec,
    claims_json,
    claims_markdown,
    evaluate_claims,
    judge,
    leaderboard,
    mean_interval,
)

__all__ = [
    "Arm",
    "Claim",
    "ClaimSpec",
    "claims_json",
    "claims_markdown",
    "evaluate_claims",
    "judge",
    "leaderboard",
    "mean_interval",
]
