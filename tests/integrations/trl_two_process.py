"""BAPOGRPOTrainer on 1 or 2 CPU processes (gloo), for tests/integrations/test_trl_distributed.py.

    python tests/integrations/trl_two_process.py MODEL_DIR OUT_DIR
    accelerate launch --multi_gpu --num_processes 2 tests/integrations/trl_two_process.py MODEL_DIR OUT_DIR

(On a machine without GPUs `--multi_gpu` starts 2 processes through torchrun and TRL's use_cpu=True
makes them CPU/gloo ranks. accelerate 1.16's `--cpu --num_processes 2` starts ONE process: its
CPU launcher needs MPI for more.)

Writes OUT_DIR/rank{R}.json with, per optimizer step:
- "fixed": two optimizer steps (micro-batches 1 and 2 of a generation, so TRL's search really
  compares ratios: at micro-batch 0 it takes them as 1) on one fixed global batch (8 sequences,
  off-policy old log-probs), each process taking its rows; the loss through `_compute_loss`,
  gradients averaged by DDP, SGD.
  Bounds, step loss (mean over ranks) and a parameter fingerprint: equal for 1 and 2 processes.
- "train": `trainer.train()` for 2 optimizer steps (TRL's own generation, off-policy: 2 micro-batches
  per generation, 1 per step): the bounds each rank used at every step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from bapo.integrations.trl import BAPOGRPOConfig, BAPOGRPOTrainer
from examples.trl.tiny_task import addition_prompts, digit_match_reward
from tests.helpers import cpu_grpo_args

GLOBAL_ROWS, GROUP, COMPLETION = 8, 4, 6


def make_trainer(model_dir: str, out: Path, per_device: int, **overrides) -> BAPOGRPOTrainer:
    settings = cpu_grpo_args(
        out / "trl",
        num_generations=GROUP,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_iterations=1,
        max_completion_length=8,
        bapo_target=0.55,
    )
    settings.update(overrides)
    return BAPOGRPOTrainer(
        model=model_dir,
        reward_funcs=digit_match_reward,
        args=BAPOGRPOConfig(**settings),
        train_dataset=Dataset.from_list(addition_prompts(64)),
    )


def global_buffer(trainer, steps: int = 2) -> list[dict]:
    """`steps` micro-batches of GLOBAL_ROWS sequences, identical on every process (seeded):
    old log-probs = the initial model's + noise, so the ratios differ from 1 and BAPO's search moves."""
    generator = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    buffer = []
    for _ in range(steps):
        prompt_ids = torch.randint(3, vocab, (GLOBAL_ROWS, 4), generator=generator)
        completion_ids = torch.randint(3, vocab, (GLOBAL_ROWS, COMPLETION), generator=generator)
        lengths = torch.randint(2, COMPLETION + 1, (GLOBAL_ROWS, 1), generator=generator)
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones_like(prompt_ids),
            "completion_ids": completion_ids,
            "completion_mask": (torch.arange(COMPLETION) < lengths).long(),
            "advantages": torch.randn(GLOBAL_ROWS, generator=generator),
        }
        with torch.no_grad():
            log_prob = trainer._completion_log_probs(trainer.model, batch)[0]
        batch["old_per_token_logps"] = log_prob + 0.4 * torch.randn(log_prob.shape, generator=generator)
        buffer.append(batch)
    tokens = sum(batch["completion_mask"].sum() for batch in buffer)  # TRL: tokens of the whole generation
    for batch in buffer:
        batch["num_items_in_batch"] = tokens
    return buffer


def fixed_batch_steps(model_dir: str, out: Path) -> list[dict]:
    probe = make_trainer(model_dir, out, per_device=GLOBAL_ROWS, num_iterations=2)
    world = probe.accelerator.num_processes
    rank = probe.accelerator.process_index
    buffer = global_buffer(probe)
    rows = slice(rank * GLOBAL_ROWS // world, (rank + 1) * GLOBAL_ROWS // world)
    local = [{k: (v[rows] if k != "num_items_in_batch" else v) for k, v in batch.items()} for batch in buffer]
    trainer = probe
    model = trainer.accelerator.prepare(trainer.model)  # DDP on 2 processes: gradients averaged over ranks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    steps = []
    for step in (1, 2):
        trainer.model.train()
        trainer._buffered_inputs, trainer._step = local, step
        trainer.current_gradient_accumulation_steps = 1
        loss = trainer._compute_loss(model, local[step % len(local)])
        trainer.accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if world > 1:  # each rank's loss is scaled by the world size and DDP averages: the mean is the step loss
            torch.distributed.all_reduce(total)
            total /= world
        search = trainer.bapo_step.solved
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        steps.append(
            {
                "lower": search.lower,
                "upper": search.upper,
                "positive_share": search.positive_share,
                # the logged diagnostic: the step's ClipStats summed over ranks, then finalized
                "logged_positive_share": trainer._metrics["train"]["bapo/positive_share"][-1],
                "logged_tokens": trainer._metrics["train"]["bapo/tokens"][-1],
                "loss": float(total),
                "param_sum": float(params.double().sum()),
                "param_abs_sum": float(params.double().abs().sum()),
                "param_head": params[:64].tolist(),
            }
        )
    return steps


class RecordBounds(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.steps = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        search = self.trainer.bapo_step.solved
        self.steps.append({"step": state.global_step, "lower": search.lower, "upper": search.upper})


def train_steps(model_dir: str, out: Path, world: int) -> list[dict]:
    trainer = make_trainer(model_dir, out, per_device=GLOBAL_ROWS // world, max_steps=2)
    record = RecordBounds(trainer)
    trainer.add_callback(record)
    trainer.train()
    return record.steps


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    fixed = fixed_batch_steps(model_dir, out)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if world != launched:
        raise SystemExit(f"launched {launched} processes but torch.distributed has {world}")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    trained = train_steps(model_dir, out, world)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"world": world, "fixed": fixed, "train": trained}))


if __name__ == "__main__":
    main()
