"""The `bapo` command: one typer app; each command lives in its own module and registers itself,
importing heavy libraries only inside the command body."""

import os

import typer

from bapo.cli import demo_cmd, eval_cmd, lab_cmd, smollm2_cmd, study_cmd, train_cmd
from bapo.cli.errors import DEBUG_ENV

HELP = """Stable off-policy RL for language models: GRPO with BAPO's adaptive
clipping (arXiv 2510.18927) and the baselines it is compared with.

\b
  bapo train CONFIG.yaml KEY=VALUE... train; --resume RUN_DIR continues
  bapo train --print-config [...]     every key: value, default, meaning
  bapo eval --model RUN_DIR --data F  avg@k / pass@k, prompts as in training
  bapo demo [--quick]                 the paper's staleness-E experiment, offline
  bapo lab [--quick]                  the Entropy-Clip mechanism on a tabular softmax policy
  bapo study [--quick|--resume DIR]   SmolLM2-135M + vLLM: does BAPO help on stale data?
  bapo plot | compare RUN_DIR ...     figures and tables from metrics.jsonl
  bapo smollm2                        SmolLM2-135M as a local HF folder

Errors print one line; --debug (or BAPO_DEBUG=1) shows the traceback."""

app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP)


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="show Python tracebacks instead of one-line errors")):
    if debug:
        os.environ[DEBUG_ENV] = "1"


train_cmd.register(app)
demo_cmd.register(app)
lab_cmd.register(app)
eval_cmd.register(app)
smollm2_cmd.register(app)
study_cmd.register(app)

if __name__ == "__main__":
    app()
