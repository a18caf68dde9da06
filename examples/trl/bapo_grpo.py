"""BAPO inside TRL's GRPOTrainer: a runnable example (CPU by default, no downloads).

    python examples/trl/bapo_grpo.py                          # tiny random Llama, toy addition task
    python examples/trl/bapo_grpo.py --model PATH_OR_HF_ID    # your model (a tokenizer with a pad token)
    python examples/trl/bapo_grpo.py --method grpo            # any bapo.core loss: grpo, clip-higher, ...

Off-policy on purpose: 8 buffered micro-batches per generation, 2 per optimizer step, 2 passes
over each (TRL's steps_per_generation / num_iterations), so the rollouts of an optimizer step are
up to 7 updates old and BAPO's bounds have something to do. Prints bapo's metrics per step.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from datasets import Dataset

from bapo.integrations.trl import BAPOGRPOConfig, BAPOGRPOTrainer

from tiny_task import addition_prompts, build_tiny_model, digit_match_reward  # beside this file

SHOWN = (
    "reward",
    "entropy",
    "bapo/lower",
    "bapo/upper",
    "bapo/positive_share",
    "bapo/search/positive_share",
    "bapo/clip_frac/upper",
    "bapo/clip_frac/lower",
    "bapo/ratio/max",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path or HF id (default: build a tiny Llama)")
    parser.add_argument("--method", default="bapo", help="bapo.core loss: bapo, grpo, clip-higher, dcpo, ...")
    parser.add_argument("--target", type=float, default=0.4, help="BAPO positive-share target rho0")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--gpu", action="store_true", help="train on the accelerator (default: CPU)")
    options = parser.parse_args()

    workdir = Path(options.output_dir or tempfile.mkdtemp(prefix="bapo-trl-"))
    model = options.model or str(build_tiny_model(workdir / "tiny-model"))
    args = BAPOGRPOConfig(
        output_dir=str(workdir / "run"),
        bapo_method=options.method,
        bapo_target=options.target,
        loss_type="dapo",  # -> bapo.core loss_agg_mode "token-mean" over the optimizer step
        per_device_train_batch_size=8,
        num_generations=8,
        gradient_accumulation_steps=2,
        steps_per_generation=8,  # > gradient_accumulation_steps: stale rollouts
        num_iterations=2,
        max_completion_length=8,
        temperature=1.0,
        beta=0.0,
        learning_rate=3e-3,
        max_steps=options.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not options.gpu,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = BAPOGRPOTrainer(
        model=model, reward_funcs=digit_match_reward, args=args, train_dataset=Dataset.from_list(addition_prompts(256))
    )
    trainer.train()
    print("step " + " ".join(f"{name:>14s}" for name in SHOWN))
    for entry in trainer.state.log_history:
        if "bapo/lower" in entry:
            print(f"{entry['step']:4d} " + " ".join(f"{entry.get(name, float('nan')):14.4f}" for name in SHOWN))


if __name__ == "__main__":
    main()
