"""bapo.analysis: reading, summarising and reporting runs of any origin (trainer, demo, lab).

evaluate.py avg@k / pass@k with batched HF generate (`bapo eval`)
runs.py     reading runs back from metrics.jsonl (identity, final eval)
plots.py    PNGs from metrics.jsonl (`bapo plot`)
report.py   report.md and the comparison table (`bapo compare`)
claims.py   one claim of the paper tested over seeds: effect, 95% interval, verdict; table and JSON
"""

from bapo.analysis.claims import Claim, claims_json, claims_markdown, judge, mean_interval

__all__ = ["Claim", "claims_json", "claims_markdown", "judge", "mean_interval"]
