"""bapo.analysis: reading, summarising and reporting runs of any origin (trainer, demo, lab).

claims.py   one claim of the paper tested over seeds: effect, 95% interval, verdict; table and JSON
"""

from bapo.analysis.claims import Claim, claims_json, claims_markdown, judge, mean_interval

__all__ = ["Claim", "claims_json", "claims_markdown", "judge", "mean_interval"]
