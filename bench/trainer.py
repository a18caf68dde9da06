"""Rollout and update throughput of bapo's trainer vs TRL's GRPOTrainer, same model/batch/lengths, one run.

    OMP_NUM_THREADS=2 python bench/trainer.py                 # tiny random Llama on CPU
    python bench/trainer.py --json                            # one JSON object (rows + ratios)
    python bench/trainer.py --device cuda --hidden 256 --new-tokens 64

Setup shared by every row: one locally built tiny Llama (random init, the demo's char tokenizer), P prompts x G
responses per rollout, at most L new tokens, temperature 1, no top-k/top-p, two optimizer updates
per rollout batch over micro-batches of M sequences, AdamW (lr 1e-6: lengths must not drift
apart), grad-clip 1.0, no KL, fp32.
  bapo-grpo        bapo.train.Trainer, loss.method=grpo (fixed clip: the baseline of the overheads)
  bapo-step        bapo.train.Trainer, loss.method=bapo, loss.bapo.scope=step (search over the whole update)
  bapo-micro       bapo.train.Trainer, loss.method=bapo, loss.bapo.scope=micro_batch
  trl              trl.GRPOTrainer, its default loss (dapo); generation_batch = P*G, 2 steps per generation
  trl-bapo-step    bapo.integrations.trl.BAPOGRPOTrainer, bapo_method=bapo, bapo_scope=step
  trl-bapo-micro   the same with bapo_scope=micro_batch
Ratios: bapo_step_overhead / bapo_micro_batch_overhead = update time per token of bapo-step /
bapo-micro over bapo-grpo (same trainer); trl_bapo_*_overhead the same inside TRL;
rollout_vs_trl / update_vs_trl = tokens/s of bapo-grpo over trl.
"Rollout" is generate + reward + behaviour log-probs in every system (TRL recomputes them when a
generation spans several optimizer steps; bapo's lean sampler reads them from the sampling pass).
Tokens are response tokens (mask sums); rollout tok/s = generated tokens / rollout seconds,
update tok/s = trained tokens / update seconds (forward, backward, optimizer step, search).
The first rollout and its updates are warm-up and not timed; each system runs --repeats times in
alternating order and keeps its fastest run per phase. Not a test: prints a table and ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root (examples/) is not on sys.path then
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Small enough that neither policy drifts during the bench: response lengths (and so the work per
# token) stay those of the shared initial model in every system. Compute does not depend on it.
LEARNING_RATE = 1e-6


@dataclass
class Throughput:
    """Seconds and response tokens of the timed rollouts and updates of one system."""

    rollout_s: float = 0.0
    rollout_tokens: int = 0
    update_s: float = 0.0
    update_tokens: int = 0

    @property
    def rollout_tps(self) -> float:
        return self.rollout_tokens / max(self.rollout_s, 1e-9)

    @property
    def update_tps(self) -> float:
        return self.update_tokens / max(self.update_s, 1e-9)


def best(measured: list[Throughput]) -> Throughput:
    """The fastest repeat per phase (a shared machine only ever slows a run down)."""
    fastest_rollout = max(measured, key=lambda result: result.rollout_tps)
    fastest_update = max(measured, key=lambda result: result.update_tps)
    return Throughput(
        fastest_rollout.rollout_s, fastest_rollout.rollout_tokens, fastest_update.update_s, fastest_update.update_tokens
    )


def bench_bapo(model_dir: Path, rows: list[dict], options, workdir: Path, method: str, scope: str) -> Throughput:
    """bapo.train: warm-up rollout + updates, then `options.rollouts` timed rollout/update pairs."""
    from bapo.train import Trainer, config_from_dict
    from examples.trl.tiny_task import digit_match_reward

    cfg = config_from_dict(
        {
            "model": {"path": str(model_dir), "device": options.device},
            "rollout": {
                "prompts_per_batch": options.prompts,
                "group_size": options.group,
                "max_new_tokens": options.new_tokens,
                "temperature": 1.0,
            },
            "loss": {"method": method, "bapo": {"scope": scope}},
            "offpolicy": {"mini_batches": 2},
            "optim": {"lr": LEARNING_RATE, "micro_batch_size": options.micro_batch, "max_grad_norm": 1.0},
            "run": {
                "output_dir": str(workdir / "bapo"),
                "rollout_steps": options.rollouts + 1,
                "progress": False,
                "tensorboard": "off",
                "checkpoint_every": 0,
                "seed": 0,
            },
        }
    )
    trainer = Trainer(
        cfg,
        examples=rows,
        progress=False,
        verifier=lambda response, row: digit_match_reward([response], [row["answer"]])[0],
    )
    result = Throughput()
    for index in range(options.rollouts + 1):
        start = time.perf_counter()
        batch, _ = trainer.rollout_step()
        middle = time.perf_counter()
        trainer.update_step(batch)
        end = time.perf_counter()
        if index > 0:  # the first pair is warm-up
            result.rollout_s += middle - start
            result.update_s += end - middle
            result.rollout_tokens += int(batch.response_mask.sum())
            result.update_tokens += int(batch.response_mask.sum())
    trainer.close()
    return result


def trl_grpo_kwargs(options, output_dir: Path, steps_per_generation: int) -> dict:
    """The GRPOConfig arguments every TRL system of the benchmarks shares: no logging or saving,
    greedy-free sampling at T=1, no KL, `options`' batch shape, half a generation's steps per
    optimizer step, bapo's learning rate and clip, 2 x (rollouts + 1) steps."""
    return {
        "output_dir": str(output_dir),
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 10**6,
        "disable_tqdm": True,
        "seed": 0,
        "beta": 0.0,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "num_generations": options.group,
        "max_completion_length": options.new_tokens,
        "per_device_train_batch_size": options.micro_batch,
        "steps_per_generation": steps_per_generation,
        "gradient_accumulation_steps": max(steps_per_generation // 2, 1),
        "learning_rate": LEARNING_RATE,
        "max_grad_norm": 1.0,
        "max_steps": 2 * (options.rollouts + 1),
        "dataloader_num_workers": 0,
    }


def timed_trl_trainer(base):
    """`base` (a GRPOTrainer class) that records generation time/tokens and trained tokens per optimizer step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_begin(self, args, state, control, **kwargs):
            self.trainer.window = {
                "start": time.perf_counter(),
                "rollout_s": 0.0,
                "rollout_tokens": 0,
                "update_tokens": 0,
            }

        def on_step_end(self, args, state, control, **kwargs):
            window = self.trainer.window
            window["total_s"] = time.perf_counter() - window.pop("start")
            self.trainer.windows.append(window)

    class Timed(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.windows: list[dict] = []
            self.window: dict = {}
            self.add_callback(StepClock(self))

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            self.window["rollout_s"] += time.perf_counter() - start
            self.window["rollout_tokens"] += int(output["completion_mask"].sum())
            return output

        def _compute_loss(self, model, inputs):
            self.window["update_tokens"] += int(inputs["completion_mask"].sum())
            return super()._compute_loss(model, inputs)

    return Timed


def bench_trl(model_dir: Path, rows: list[dict], options, workdir: Path, bapo_scope: str | None) -> Throughput:
    """TRL's GRPOTrainer (or bapo's subclass): 1 + `options.rollouts` generations, 2 optimizer steps each."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from bapo.integrations.trl import BAPOGRPOConfig, BAPOGRPOTrainer
    from examples.trl.tiny_task import digit_match_reward

    sequences = options.prompts * options.group
    steps_per_generation = sequences // options.micro_batch
    bapo = bapo_scope is not None
    config_class, trainer_class = (BAPOGRPOConfig, BAPOGRPOTrainer) if bapo else (GRPOConfig, GRPOTrainer)
    extra = {"bapo_method": "bapo", "bapo_scope": bapo_scope} if bapo else {}
    args = config_class(
        **trl_grpo_kwargs(options, workdir / (f"trl-bapo-{bapo_scope}" if bapo else "trl"), steps_per_generation),
        use_cpu=options.device == "cpu",
        num_iterations=1,
        lr_scheduler_type="constant",
        **extra,
    )
    trainer = timed_trl_trainer(trainer_class)(
        model=str(model_dir), reward_funcs=digit_match_reward, args=args, train_dataset=Dataset.from_list(rows)
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    result = Throughput()
    for window in trainer.windows[2:]:  # the first generation's two steps are warm-up
        result.rollout_s += window["rollout_s"]
        result.rollout_tokens += window["rollout_tokens"]
        result.update_s += window["total_s"] - window["rollout_s"]
        result.update_tokens += window["update_tokens"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="P: prompts per rollout")
    parser.add_argument("--group", type=int, default=8, help="G: responses per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="L: max new tokens")
    parser.add_argument("--micro-batch", type=int, default=16, help="M: sequences per forward+backward")
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system, best kept (order alternates)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a local model directory instead of the tiny random Llama")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--skip-bapo-in-trl", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    options = parser.parse_args()
    if (options.prompts * options.group) % (2 * options.micro_batch):
        parser.error("P*G must be a multiple of 2*M (two optimizer updates per rollout, whole micro-batches)")
    if options.threads:
        torch.set_num_threads(options.threads)

    from examples.trl.tiny_task import addition_prompts, build_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="bapo-bench-"))
    model_dir = (
        Path(options.model)
        if options.model
        else build_tiny_model(workdir / "model", hidden_size=options.hidden, num_layers=options.layers)
    )
    rows = addition_prompts(options.prompts * (options.rollouts + 2) * 4, seed=1)
    systems = {
        "bapo-grpo": lambda run_dir: bench_bapo(model_dir, rows, options, run_dir, "grpo", "step"),
        "bapo-step": lambda run_dir: bench_bapo(model_dir, rows, options, run_dir, "bapo", "step"),
        "bapo-micro": lambda run_dir: bench_bapo(model_dir, rows, options, run_dir, "bapo", "micro_batch"),
        "trl": lambda run_dir: bench_trl(model_dir, rows, options, run_dir, None),
    }
    if not options.skip_bapo_in_trl:
        systems["trl-bapo-step"] = lambda run_dir: bench_trl(model_dir, rows, options, run_dir, "step")
        systems["trl-bapo-micro"] = lambda run_dir: bench_trl(model_dir, rows, options, run_dir, "micro_batch")
    runs: dict[str, list[Throughput]] = {name: [] for name in systems}
    for repeat in range(options.repeats):  # alternate the order so that load drifts hit every system
        order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
        for name in order:
            # each system its own run directory: the trainer refuses to overwrite an existing run
            runs[name].append(systems[name](workdir / f"repeat{repeat}" / name))
    results = {name: best(measured) for name, measured in runs.items()}

    def per_token_update(name: str) -> float:
        return 1.0 / results[name].update_tps

    ratios = {
        "bapo_step_overhead": per_token_update("bapo-step") / per_token_update("bapo-grpo"),
        "bapo_micro_batch_overhead": per_token_update("bapo-micro") / per_token_update("bapo-grpo"),
        "rollout_vs_trl": results["bapo-grpo"].rollout_tps / results["trl"].rollout_tps,
        "update_vs_trl": results["bapo-grpo"].update_tps / results["trl"].update_tps,
    }
    if not options.skip_bapo_in_trl:
        ratios["trl_bapo_step_overhead"] = per_token_update("trl-bapo-step") / per_token_update("trl")
        ratios["trl_bapo_micro_batch_overhead"] = per_token_update("trl-bapo-micro") / per_token_update("trl")
    setup = (f"Llama {options.layers}x{options.hidden}" if not options.model else options.model) + (
        f", {options.prompts}x{options.group} responses <= {options.new_tokens} tokens, micro-batch "
        f"{options.micro_batch}, {options.rollouts} timed rollouts, best of {options.repeats}, "
        f"device {options.device}, "
        f"torch threads {torch.get_num_threads()}"
    )
    if options.json:
        print(
            json.dumps(
                {
                    "setup": setup,
                    **ratios,
                    "systems": {
                        name: {
                            "rollout_tok_s": r.rollout_tps,
                            "update_tok_s": r.update_tps,
                            "rollout_s": r.rollout_s,
                            "update_s": r.update_s,
                            "rollout_tokens": r.rollout_tokens,
                            "update_tokens": r.update_tokens,
                        }
                        for name, r in results.items()
                    },
                }
            )
        )
        return
    print(f"\n{setup}")
    print(
        f"{'system':15s} {'rollout tok/s':>14s} {'update tok/s':>13s} {'rollout s':>10s} {'update s':>9s} "
        f"{'rollout tok':>12s} {'update tok':>11s} {'mean len':>9s}"
    )
    sequences = options.prompts * options.group * options.rollouts
    for name, result in results.items():
        print(
            f"{name:15s} {result.rollout_tps:14.1f} {result.update_tps:13.1f} {result.rollout_s:10.2f} "
            f"{result.update_s:9.2f} {result.rollout_tokens:12d} {result.update_tokens:11d} "
            f"{result.rollout_tokens / sequences:9.1f}"
        )
    for name, value in ratios.items():
        print(f"{name:30s} {value:6.3f}")


if __name__ == "__main__":
    main()
