"""bapo.demo: the paper's staleness-E experiment in miniature, offline, on 2 CPU cores.

task.py       the procedural arithmetic task, its verifier and the fixed held-out split
warmstart.py  supervised warm start on slipped demonstrations, cached by a hash of its settings
demo.py       the plan (profiles), one bapo.train run per (method, setting, seed), the whole demo
progress.py   the single rich progress bar
The tiny model lives in bapo.train.tiny; evaluation, plots and reports in bapo.analysis.
"""
