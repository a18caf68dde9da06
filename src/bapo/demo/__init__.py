"""bapo.demo: the paper's staleness experiment in miniature, offline, on 2 CPU cores.

task.py       the procedural arithmetic task, its verifier and the fixed held-out split
model.py      the character tokenizer (`tokenizers`) and the tiny random-init Llama
warmstart.py  supervised warm start on slipped demonstrations, cached by a hash of its settings
evaluate.py   avg@k / pass@k with batched HF generate (also `bapo eval`)
demo.py       the plan (profiles), one bapo.train run per (method, setting, seed), the whole demo
progress.py   the single rich progress bar
runs.py       reading runs back (metrics.jsonl, identity, final eval)
plots.py      PNGs from metrics.jsonl (also `bapo plot`)
report.py     report.md and the comparison table (also `bapo compare`)
"""
