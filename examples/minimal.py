"""Off-policy GRPO with BAPO's adaptive clipping in one file, to read top to bottom (CleanRL style).

    python examples/minimal.py                        # bapo, async delay 2, 40 updates on the demo's warm start
    python examples/minimal.py grpo --async-delay 4   # any registered loss: grpo, clip-higher, dual-clip, topr, dcpo
    python examples/minimal.py --model DIR          # any causal LM + tokenizer saved with save_pretrained

One update = one rollout step: sample G responses per prompt with the current policy, score them,
push the batch into a FIFO of k+1 batches and train on the oldest one (generated k updates ago: the
async delay k), with one optimizer update of `bapo.core.policy_loss`. Everything `bapo.train` adds
(the paper's staleness E: E+1 updates per rollout batch, micro-batches, partial rollout, replay, KL,
checkpoints, logging) is left out; the algorithm is the same.
The task is the demo's (bapo.experiments.task), used as `bapo demo` uses it: its training rows, its verifier
(reward 1 when every "7+5=12" line is true and the last hits the target) and its response budget.
The first run trains and caches the demo's warm start (~100 s on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import collections
import math

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo.core import POLICY_LOSSES, BAPOConfig, BAPOStep, TokenBatch, group_advantages, policy_loss
from bapo.experiments.task import TaskConfig, make_split, verify
from bapo.experiments.warmstart import WarmStartConfig, warm_start  # the demo's tiny model, warm-started and cached


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("method", nargs="?", default="bapo", choices=sorted(POLICY_LOSSES))
    parser.add_argument("--async-delay", type=int, default=2, help="k: train on the batch generated k updates ago")
    parser.add_argument("--staleness", type=int, help=argparse.SUPPRESS)  # renamed: refused below
    parser.add_argument("--updates", type=int, default=40, help="optimizer updates (= rollout steps)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout batch")
    parser.add_argument("--group-size", type=int, default=8, help="G: responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=TaskConfig().max_new_tokens, help="the task's budget")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--target", type=float, default=0.5, help="bapo: positive share rho0 the bounds aim for")
    parser.add_argument("--model", default=None, help="model directory (default: the demo's cached warm start)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.staleness is not None:
        parser.error(
            "--staleness was renamed --async-delay (k: train on the batch generated k updates ago); "
            "the paper's staleness E (E+1 updates per rollout batch) is bapo train's offpolicy.mini_batches - 1"
        )
    if args.async_delay < 0:
        parser.error(f"--async-delay: {args.async_delay} must be >= 0")
    return args


def response_log_probs(model, batch: dict, temperature: float) -> tuple[Tensor, Tensor]:
    """log pi(y_t | prompt, y_<t) of every response token [N, R] and the response logits [N, R, V],
    both at the sampling temperature, so they describe the distribution `generate` sampled from."""
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp_min(0)  # as generate() numbers left-padded prompts
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    prompt_width = batch["prompt_ids"].shape[1]
    response_logits = logits[:, prompt_width - 1 : -1].float() / temperature  # position t predicts token t+1
    log_prob = torch.log_softmax(response_logits, dim=-1).gather(-1, batch["response_ids"].unsqueeze(-1))
    return log_prob.squeeze(-1), response_logits


@torch.no_grad()
def rollout(model, tokenizer, train_rows: list[dict], args: argparse.Namespace, policy_version: int) -> dict:
    """One rollout batch of N = prompts * G responses, each prompt's G responses contiguous.

    Returns prompt_ids / prompt_mask [N, P] (left-padded), response_ids / response_mask [N, R],
    old_log_prob [N, R] (the behaviour policy's), rewards [N], advantages [N], and policy_version:
    the number of optimizer updates the generating weights had seen.
    """
    model.eval()
    prompt_rows = [train_rows[i] for i in torch.randint(len(train_rows), (args.prompts,)).tolist()]
    group_rows = [row for row in prompt_rows for _ in range(args.group_size)]
    prompts = tokenizer([row["prompt"] for row in group_rows], return_tensors="pt", padding=True)
    # top_k=0 / top_p=1: sample from the full softmax at `temperature`, the one old_log_prob describes
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
    sequences = model.generate(
        **prompts,
        **sampling,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    response_ids = sequences[:, prompts["input_ids"].shape[1] :]
    # a response is its tokens up to and including the first EOS (the model must learn to stop)
    is_eos = (response_ids == tokenizer.eos_token_id).long()
    response_mask = (is_eos.cumsum(1) - is_eos) == 0
    response_ids = response_ids.masked_fill(~response_mask, tokenizer.pad_token_id)
    response_texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    rewards = torch.tensor([verify(text, row) for text, row in zip(response_texts, group_rows)])
    advantages, _ = group_advantages(rewards, args.group_size)  # (r - group mean) / group std; 0 if all equal
    batch = {
        "prompt_ids": prompts["input_ids"],
        "prompt_mask": prompts["attention_mask"].bool(),
        "response_ids": response_ids,
        "response_mask": response_mask,
        "rewards": rewards,
        "advantages": advantages,
        "policy_version": policy_version,
    }
    batch["old_log_prob"], _ = response_log_probs(model, batch, args.temperature)
    return batch


PRINTED_METRICS = ("lower", "upper", "positive_share", "clip_frac/upper", "clip_frac/lower", "entropy", "ratio/max")


def main(argv: list[str] | None = None) -> list[dict]:
    """Train and print one line of metrics per update; returns those lines as dicts."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # prompt choice and sampling
    demo = WarmStartConfig()  # the demo's task, tiny model and SFT settings
    model_dir = args.model or warm_start(demo)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"  # generate appends after the last column
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_rows, _ = make_split(demo.task)  # the demo's {"prompt", "answer"} rows; held-out rows are not trained on
    # bapo's bounds are searched on each update's own batch; fixed-bound losses take their defaults
    # BAPO's per-update protocol: bounds searched on the update's batch (one micro-batch here)
    bapo_step = BAPOStep(BAPOConfig(target=args.target)) if args.method == "bapo" else None

    # The async-delay FIFO holds k+1 rollout batches, oldest first. Before update 0 it is filled with
    # batches of the initial policy; afterwards each update adds one batch from the current policy
    # and trains on the oldest, so from update k on every batch is exactly k updates old.
    fifo: collections.deque[dict] = collections.deque()
    history = []
    for update in range(args.updates):
        while len(fifo) < args.async_delay + 1:
            fifo.append(rollout(model, tokenizer, train_rows, args, policy_version=update))
        batch = fifo.popleft()

        model.train()
        log_prob, response_logits = response_log_probs(model, batch, args.temperature)
        loss_params = {}
        if bapo_step is not None:
            bapo_step.begin(micro_batches=1)
            searched = TokenBatch.from_log_probs(
                log_prob.detach(), batch["old_log_prob"], batch["advantages"], batch["response_mask"]
            )
            loss_params["bounds"] = bapo_step.bounds_for(searched)
        loss, metrics = policy_loss(
            log_prob,
            batch["old_log_prob"],
            batch["advantages"],
            batch["response_mask"],
            args.method,
            logits=response_logits.detach(),
            **loss_params,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
        if math.isfinite(loss.item()) and math.isfinite(grad_norm):  # a non-finite update is skipped, not applied
            optimizer.step()
        if bapo_step is not None:
            bapo_step.end()

        row = {
            "update": update,
            "data_version": batch["policy_version"],
            "policy_lag": update - batch["policy_version"],  # optimizer updates since the data's policy
            "reward": batch["rewards"].mean().item(),
            "loss": loss.item(),
            "grad_norm": grad_norm,
            **{name: metrics[name] for name in PRINTED_METRICS},
        }
        history.append(row)
        print(" ".join(f"{name}={value:.4g}" for name, value in row.items()), flush=True)
    return history


if __name__ == "__main__":
    main()
