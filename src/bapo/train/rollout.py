"""Rollout: G sampled responses per prompt (bapo.train.sampling: a lean KV-cache loop, or HF
`generate`), the behaviour log-prob of every token (read from the sampling pass by the lean loop on
an fp32 model, else recomputed by a forward of the same weights at the same temperature), rewards
from the verifier, advantages: group advantages, or DCPO's smooth advantage standardisation over
each prompt's reward history (`loss.advantages`; auto = smooth for loss.method=dcpo).

Partial rollout (rollout.segment_tokens = L) runs through the same code: every generation pass
adds at most L tokens to each unfinished response; a group trains once all its G responses are
finished (EOS, stop string, or max_new_tokens), and every token keeps the log-prob and the
policy version that produced it. Without L a pass generates the whole response, so one pass
per step finishes everything and this is plain on-policy GRPO sampling.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from bapo.core import PromptRewardHistory, group_advantages
from bapo.train.config import ENGINE_GAP_LIMIT, TrainConfig
from bapo.train.correction import logp_gap_metrics
from bapo.train.data import PromptSampler
from bapo.train.logprobs import batched_log_probs
from bapo.train.rewards import score
from bapo.train.sampling import SamplingParams, hf_sample, lean_sample, resolve_sampler


@dataclass
class Batch:
    """N = groups * G finished responses, padded; lives on CPU between rollout and update."""

    prompt_ids: Tensor  # [N, P] long, left-padded
    prompt_mask: Tensor  # [N, P] bool
    response_ids: Tensor  # [N, R] long, right-padded
    response_mask: Tensor  # [N, R] bool: sampled tokens (EOS included)
    old_log_prob: Tensor  # [N, R] float32, behaviour log-prob of each token (logits / T)
    versions: Tensor  # [N, R] int64, policy version that sampled each token (-1 on padding)
    rewards: Tensor  # [N] float32
    advantages: Tensor  # [N] float32, group-normalised (or DCPO's smooth standardisation)
    truncated: Tensor  # [N] bool: reached max_new_tokens without EOS / stop string
    example_idx: Tensor  # [N] int64, row of the dataset
    ref_log_prob: Tensor | None = None  # [N, R] reference-model log-prob (only with loss.kl_coef > 0)
    # [N, R] proximal-policy log-prob: the weights before this batch's first update (decoupled PPO only)
    proximal_log_prob: Tensor | None = None
    # [N, R] the engine's log-prob of each token at its behaviour version (rollout.backend=vllm only;
    # old_log_prob is then the trainer's recompute of the same weights): bapo.train.correction
    engine_log_prob: Tensor | None = None

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def tokens(self) -> int:
        return int(self.response_mask.sum())

    def select(self, rows: Tensor) -> Batch:
        return Batch(**{name: None if value is None else value[rows] for name, value in self.state_dict().items()})

    def to(self, device) -> Batch:
        return Batch(**{name: None if value is None else value.to(device) for name, value in self.state_dict().items()})

    def state_dict(self) -> dict:
        return {spec.name: getattr(self, spec.name) for spec in fields(self)}

    @staticmethod
    def cat(batches: list[Batch], pad_id: int) -> Batch:
        """Rows of several batches (replay); prompts re-padded on the left, responses on the right."""
        prompt_width = max(batch.prompt_ids.shape[1] for batch in batches)
        response_width = max(batch.response_ids.shape[1] for batch in batches)
        fill = {
            "prompt_ids": pad_id,
            "prompt_mask": False,
            "response_ids": pad_id,
            "response_mask": False,
            "old_log_prob": 0.0,
            "versions": -1,
            "ref_log_prob": 0.0,
            "proximal_log_prob": 0.0,
            "engine_log_prob": 0.0,
        }
        out = {}
        for spec in fields(Batch):
            parts = [getattr(batch, spec.name) for batch in batches]
            if any(part is None for part in parts):
                out[spec.name] = None
            elif parts[0].dim() == 1:
                out[spec.name] = torch.cat(parts)
            else:
                left = spec.name.startswith("prompt")
                width = prompt_width if left else response_width
                padded = []
                for part in parts:
                    extra = part.new_full((part.shape[0], width - part.shape[1]), fill[spec.name])
                    padded.append(torch.cat([extra, part] if left else [part, extra], dim=1))
                out[spec.name] = torch.cat(padded)
        return Batch(**out)


def engine_gap_metrics(gap: Tensor) -> dict:
    """rollout/logp_diff/{mean,max} of the probed tokens' |trainer - engine| log-prob gap [n] under
    rollout.behaviour_log_prob=engine, with a warning when its mean exceeds ENGINE_GAP_LIMIT."""
    if not len(gap):
        return {}
    metrics = logp_gap_metrics(gap)
    if metrics["rollout/logp_diff/mean"] > ENGINE_GAP_LIMIT:
        warnings.warn(  # one text: Python shows it once per run, the numbers are in every row
            f"the engine's log-probs differ from the trainer's by more than {ENGINE_GAP_LIMIT:g} on average "
            "(rollout/logp_diff/mean): they are not the trainer's policy; use rollout.behaviour_log_prob=recompute",
            stacklevel=1,
        )
    return metrics


def pad(rows: list[list], value, left: bool, dtype=torch.long) -> tuple[Tensor, Tensor]:
    """Lists of unequal length -> [N, W] tensor and [N, W] bool mask."""
    width = max((len(row) for row in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for index, row in enumerate(rows):
        if row:
            span = slice(width - len(row), width) if left else slice(0, len(row))
            out[index, span] = torch.tensor(row, dtype=dtype)
            mask[index, span] = True
    return out, mask


class Rollout:
    """Prompt groups in flight (partial responses), finished groups waiting to train, and the
    step that turns them into a `Batch`. Its whole state is plain lists (checkpointed)."""

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer,
        prompts: list[list[int]],
        examples: list[dict],
        verifier,
        sampler: PromptSampler,
        eos_ids: list[int],
    ):
        self.cfg, self.rollout_cfg = cfg, cfg.rollout
        self.tokenizer, self.prompts, self.examples = tokenizer, prompts, examples
        self.verifier, self.sampler = verifier, sampler
        self.eos_ids = torch.tensor(sorted(set(eos_ids)))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos_ids[0])
        self.segment = self.rollout_cfg.segment_tokens or self.rollout_cfg.max_new_tokens
        # groups in flight + finished ones: enough for every step to finish a batch in one pass
        # once the pipeline is full (one cohort of prompts per segment of the response)
        self.capacity = self.rollout_cfg.prompts_per_batch * math.ceil(self.rollout_cfg.max_new_tokens / self.segment)
        self.in_flight: list[dict] = []
        self.ready: list[dict] = []
        # DCPO's per-prompt reward statistics, keyed by dataset index (loss.advantages=dcpo_smooth)
        self.history = PromptRewardHistory()
        self.engine = None  # rollout.backend=vllm: bapo.train.vllm_engine.VLLMEngine, made at the first pass
        self.stop = None
        if self.rollout_cfg.stop:
            from transformers.generation.stopping_criteria import StopStringCriteria

            self.stop = StopStringCriteria(tokenizer, self.rollout_cfg.stop)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "in_flight": self.in_flight,
            "ready": self.ready,
            "sampler": self.sampler.state_dict(),
            "history": self.history.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.in_flight, self.ready = state["in_flight"], state["ready"]
        self.sampler.load_state_dict(state["sampler"])
        self.history = PromptRewardHistory()
        self.history.load_state_dict(state["history"])

    # -- one rollout step -------------------------------------------------------------------
    def step(self, model, version: int) -> tuple[Batch, dict]:
        """Generate with the current policy (version) until prompts_per_batch groups are ready,
        then return them as a Batch (plus rollout metrics). At least one pass always runs, so
        unfinished responses advance every step."""
        start, new_tokens, passes, failures = time.perf_counter(), 0, 0, 0
        gaps: list[Tensor] = []  # rollout.behaviour_log_prob=engine: |trainer - engine| of the probed tokens
        engine = self.engine
        pushed = (engine.pushes, engine.push_seconds, engine.sample_seconds) if engine is not None else (0, 0.0, 0.0)
        want = self.rollout_cfg.prompts_per_batch
        while passes == 0 or len(self.ready) < want:
            if len(self.in_flight) + len(self.ready) + want <= self.capacity:
                self.in_flight += [self._new_group(example) for example in self.sampler.take(want)]
            if not self.in_flight:
                break
            new_tokens += self._generate_pass(model, version, gaps)
            failures += self._collect_finished()
            passes += 1
        groups, self.ready = self.ready[:want], self.ready[want:]
        batch, dropped, zero_var = self._to_batch(groups)
        metrics = {
            "rollout/passes": passes,
            "verifier/failures": failures,
            "groups/zero_variance": zero_var,
            "groups/dropped": dropped,
            "groups/in_flight": len(self.in_flight),
            "groups/waiting": len(self.ready),
            "tokens/rollout": new_tokens,
            "time/rollout_s": time.perf_counter() - start,
        }
        if self.engine is not None:  # rollout.backend=vllm: weight pushes of this step (in time/rollout_s)
            metrics["rollout/vllm_pushes"] = self.engine.pushes - pushed[0]
            metrics["time/vllm_push_s"] = self.engine.push_seconds - pushed[1]
            metrics["time/vllm_sample_s"] = self.engine.sample_seconds - pushed[2]  # the rest: recompute, scoring
        if gaps:
            metrics.update(engine_gap_metrics(torch.cat(gaps)))
        return batch, metrics

    def _new_group(self, example: int) -> dict:
        seqs = [
            {"response": [], "logp": [], "version": [], "done": False, "truncated": False}
            for _ in range(self.rollout_cfg.group_size)
        ]
        return {"example": example, "seqs": seqs, "rewards": None}

    @torch.no_grad()
    def _generate_pass(self, model, version: int, gaps: list[Tensor]) -> int:
        """Up to `segment` new tokens for every unfinished response; returns tokens added. With
        rollout.behaviour_log_prob=engine, appends the probed tokens' |trainer - engine| gap to `gaps`."""
        live = [seq for group in self.in_flight for seq in group["seqs"] if not seq["done"]]
        owners = [group for group in self.in_flight for seq in group["seqs"] if not seq["done"]]
        if not live:
            return 0
        context = [self.prompts[group["example"]] + seq["response"] for group, seq in zip(owners, live)]
        ctx_ids, ctx_mask = pad(context, self.pad_id, left=True)
        remaining = torch.tensor([self.rollout_cfg.max_new_tokens - len(seq["response"]) for seq in live])
        budget = min(self.segment, int(remaining.max()))
        params = SamplingParams(self.rollout_cfg.temperature, self.rollout_cfg.top_k, self.rollout_cfg.top_p)
        was_training = model.training  # (train mode only for gradient checkpointing, which breaks the KV cache)
        model.eval()
        engine_log_prob = None
        if self.rollout_cfg.backend == "vllm":
            # the engine samples with the trainer's weights of `version` (pushed when it changed);
            # its own log-probs are kept for the gap, the trainer recomputes the ratio's denominator
            engine = self._vllm_engine(model)
            engine.sync(model, version)
            sampled = engine.sample(
                context, remaining.clamp_max(budget).tolist(), params, self.eos_ids.tolist(), self.pad_id
            )
            engine_log_prob, sampled.log_prob = sampled.log_prob, None
        else:
            # model, context, budget, sampling params, stop ids, pad: what both samplers take
            common = (model, ctx_ids, ctx_mask, budget, params, self.eos_ids.tolist(), self.pad_id)
            if resolve_sampler(self.rollout_cfg.sampler, model) == "lean":
                sampled = lean_sample(*common, row_budget=remaining.clamp_max(budget), stop=self.stop)
            else:
                sampled = hf_sample(*common, tokenizer=self.tokenizer, stop_strings=self.rollout_cfg.stop)
        model.train(was_training)
        width = ctx_ids.shape[1]
        new = sampled.tokens  # [n, <= budget]
        length, ended = self._segment_ends(torch.cat([ctx_ids, new], dim=1), width, remaining)
        new_mask = torch.arange(new.shape[1]) < length[:, None]
        log_prob = sampled.log_prob
        # The sampling pass's log-probs equal a recompute to ~1e-6 in fp32 (tests/train/test_sampling.py);
        # in half precision (weights, or the update's bf16 autocast) the cached decode and the full
        # forward round differently: recompute in the update's precision (same weights, same
        # temperature, as verl does), so a fresh batch's ratios are ~1. vLLM: always the trainer's recompute.
        autocast = self.cfg.model.autocast
        engine_behaviour = engine_log_prob is not None and self.rollout_cfg.behaviour_log_prob == "engine"
        if engine_behaviour:
            # verl's bypass mode: the engine's own log-probs are the denominator (float32 both sides, checked
            # by the config); the first G unfinished rows (a group's worth) are still recomputed, so the
            # gap is measured every pass
            probe = slice(0, min(len(live), self.rollout_cfg.group_size))
            probed = self._recompute(
                model, owners[probe], live[probe], ctx_ids[probe], ctx_mask[probe], new[probe], new_mask[probe]
            )
            gaps.append((probed - engine_log_prob[probe]).abs()[new_mask[probe]])
            log_prob, engine_log_prob = engine_log_prob, None  # no correction: the weight would be 1
        elif log_prob is None or next(model.parameters()).dtype != torch.float32 or autocast != "none":
            log_prob = self._recompute(model, owners, live, ctx_ids, ctx_mask, new, new_mask)
        lengths = length.tolist()
        for row, seq in enumerate(live):
            kept = lengths[row]
            if engine_log_prob is not None:  # first vLLM pass of this response: its earlier tokens (none, or
                seq.setdefault("engine_logp", list(seq["logp"]))  # begun by backend hf before a resume) as they are
            seq["response"] += new[row, :kept].tolist()
            seq["logp"] += log_prob[row, :kept].tolist()
            seq["version"] += [version] * kept
            if engine_log_prob is not None:
                seq["engine_logp"] += engine_log_prob[row, :kept].tolist()
            if bool(ended[row]) or len(seq["response"]) >= self.rollout_cfg.max_new_tokens:
                seq["done"], seq["truncated"] = True, not bool(ended[row])
        return int(length.sum())

    def _recompute(self, model, owners, live, ctx_ids, ctx_mask, new, new_mask) -> Tensor:
        """Behaviour log-probs [n, budget] of the `new` tokens [n, budget] (`new_mask`) of the `live`
        rows, recomputed by the trainer's forward. With model.shared_prompt_forward the context is
        split into the group's prompt (shared by its rows) and each row's earlier segments (partial
        rollout), which join the response, so a group's prompt still runs once; else the context
        [n, C] (ctx_ids / ctx_mask) is the prompt."""
        cfg = self.cfg
        common = (cfg.rollout.temperature, cfg.rollout.logprob_batch_size, cfg.model.autocast)
        if not cfg.model.shared_prompt_forward:
            return batched_log_probs(model, ctx_ids, ctx_mask, new, new_mask, *common, shared_prompt=False)
        prompt_ids, prompt_mask = pad([self.prompts[group["example"]] for group in owners], self.pad_id, left=True)
        earlier = torch.tensor([len(seq["response"]) for seq in live])
        budget = new.shape[1]
        width = int(earlier.max()) + budget
        response_ids = torch.full((len(live), width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((len(live), width), dtype=torch.bool)
        columns = earlier[:, None] + torch.arange(budget)  # [n, budget]: where each row's new tokens go
        for row, seq in enumerate(live):
            response_ids[row, : len(seq["response"])] = torch.tensor(seq["response"], dtype=torch.long)
            response_mask[row, : len(seq["response"])] = True
        response_ids.scatter_(1, columns, new)
        response_mask.scatter_(1, columns, new_mask)
        log_prob = batched_log_probs(model, prompt_ids, prompt_mask, response_ids, response_mask, *common)
        return log_prob.gather(1, columns)

    @torch.no_grad()
    def sample_texts(self, model, version: int, prompts: list[list[int]], n: int, chunk: int = 512) -> list[list[str]]:
        """n decoded responses per tokenized prompt -> [len(prompts)][n] strings (specials dropped),
        drawn like the rollout (its backend, temperature, top-k / top-p, max_new_tokens, EOS) but
        outside it: no group, no reward, the rollout's state untouched (held-out evaluation with
        the engine that trains, so a vLLM run is scored at vLLM's speed). The caller seeds torch's
        generator (the vLLM engine draws its request seeds from it)."""
        rows = [prompt for prompt in prompts for _ in range(n)]
        params = SamplingParams(self.rollout_cfg.temperature, self.rollout_cfg.top_k, self.rollout_cfg.top_p)
        budget, eos = self.rollout_cfg.max_new_tokens, self.eos_ids.tolist()
        was_training = model.training
        model.eval()
        texts: list[str] = []
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            if self.rollout_cfg.backend == "vllm":
                engine = self._vllm_engine(model)
                engine.sync(model, version)
                tokens = engine.sample(part, [budget] * len(part), params, eos, self.pad_id).tokens
            else:
                ctx_ids, ctx_mask = pad(part, self.pad_id, left=True)
                common = (model, ctx_ids, ctx_mask, budget, params, eos, self.pad_id)
                if resolve_sampler(self.rollout_cfg.sampler, model) == "lean":
                    tokens = lean_sample(*common, row_budget=torch.full((len(part),), budget)).tokens
                else:
                    tokens = hf_sample(*common, tokenizer=self.tokenizer).tokens
            for row in tokens.tolist():
                ends = [col for col, token in enumerate(row) if token in eos]
                texts.append(self.tokenizer.decode(row[: ends[0]] if ends else row, skip_special_tokens=True))
        model.train(was_training)
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _vllm_engine(self, model):
        """The colocated vLLM engine (imported and built at the first vLLM pass only)."""
        if self.engine is None:
            from bapo.train.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(self.cfg, model, self.tokenizer)
        return self.engine

    def close(self) -> None:
        """Release the vLLM engine, if one was built (a no-op for the in-process samplers)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _segment_ends(self, out: Tensor, width: int, remaining: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens to keep per row [n] and whether the row ended by EOS or a stop string [n]."""
        new = out[:, width:]
        n, m = new.shape
        cols = torch.arange(m).expand(n, m)
        hit = torch.isin(new, self.eos_ids)
        if self.stop is not None:  # a stop string ends with token j: test every prefix, all rows at once
            ends_stop = torch.stack([self.stop(out[:, : width + j + 1], None) for j in range(m)], dim=1) if m else hit
            hit = hit | ends_stop.to(hit.device)
        first = torch.where(hit, cols, m).amin(1) if m else torch.zeros(n, dtype=torch.long)  # m = none
        ended = (first < m) & (first < remaining)
        length = torch.minimum(torch.where(ended, first + 1, torch.full_like(first, m)), remaining)
        return length, ended

    def _collect_finished(self) -> int:
        """Score groups whose responses are all done, move them to `ready`; returns failures."""
        finished = [group for group in self.in_flight if all(seq["done"] for seq in group["seqs"])]
        if not finished:
            return 0
        self.in_flight = [group for group in self.in_flight if not all(seq["done"] for seq in group["seqs"])]
        seqs = [seq for group in finished for seq in group["seqs"]]
        texts = self.tokenizer.batch_decode([seq["response"] for seq in seqs], skip_special_tokens=True)
        rows = [self.examples[group["example"]] for group in finished for _ in group["seqs"]]
        rewards, failures = score(self.verifier, texts, rows, self.cfg.reward.timeout_s)
        for group, group_rewards in zip(finished, rewards.split(self.rollout_cfg.group_size)):
            group["rewards"] = group_rewards.tolist()
        self.ready += finished
        return failures

    def _smooth_advantages(self, examples: list[int], rewards: Tensor) -> Tensor:
        """DCPO's smooth advantages [N] for groups of prompts `examples` [P] (dataset indices) with
        rewards [N = P * group_size], updating each prompt's history. A prompt that occurs k times
        in one batch (a small dataset, or cohorts of partial rollout finishing together) is seen
        as k successive steps, in batch order: round j takes every prompt's j-th occurrence."""
        group_size = self.rollout_cfg.group_size
        advantages = torch.empty_like(rewards)
        seen: dict[int, int] = {}
        rounds: list[list[int]] = []  # group positions, each prompt at most once per round
        for position, example in enumerate(examples):
            occurrence = seen[example] = seen.get(example, -1) + 1
            if occurrence == len(rounds):
                rounds.append([])
            rounds[occurrence].append(position)
        for positions in rounds:
            rows = (torch.tensor(positions)[:, None] * group_size + torch.arange(group_size)).reshape(-1)
            advantages[rows] = self.history.advantages([examples[p] for p in positions], rewards[rows], group_size).to(
                rewards.dtype
            )
        return advantages

    def _to_batch(self, groups: list[dict]) -> tuple[Batch, int, int]:
        """Finished groups -> Batch with group advantages; drops zero-variance groups when asked."""
        group_size = self.rollout_cfg.group_size
        rewards = torch.tensor([reward for group in groups for reward in group["rewards"]], dtype=torch.float32)
        advantages, zero_var = group_advantages(rewards, group_size, scale_by_std=self.cfg.loss.scale_by_std)
        if self.cfg.loss.resolved_advantages == "dcpo_smooth":
            advantages = self._smooth_advantages([group["example"] for group in groups], rewards)
        zero_groups = zero_var.reshape(-1, group_size)[:, 0]
        keep = torch.ones(len(groups), dtype=torch.bool)
        if self.cfg.loss.zero_variance == "drop":
            keep = ~zero_groups
        kept = [group for group, keep_group in zip(groups, keep.tolist()) if keep_group]
        seqs = [seq for group in kept for seq in group["seqs"]]
        examples = [group["example"] for group in kept for _ in group["seqs"]]
        rows = keep.repeat_interleave(group_size)
        prompt_ids, prompt_mask = pad([self.prompts[example] for example in examples], self.pad_id, left=True)
        response_ids, response_mask = pad([seq["response"] for seq in seqs], self.pad_id, left=False)
        old_log_prob, _ = pad([seq["logp"] for seq in seqs], 0.0, left=False, dtype=torch.float32)
        versions, _ = pad([seq["version"] for seq in seqs], -1, left=False)
        engine_log_prob = None
        if self.rollout_cfg.backend == "vllm" and self.rollout_cfg.behaviour_log_prob == "recompute":
            engine_logp = [seq.get("engine_logp", seq["logp"]) for seq in seqs]
            engine_log_prob, _ = pad(engine_logp, 0.0, left=False, dtype=torch.float32)
        batch = Batch(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            old_log_prob,
            versions,
            rewards[rows],
            advantages[rows].float(),
            torch.tensor([seq["truncated"] for seq in seqs], dtype=torch.bool),
            torch.tensor(examples, dtype=torch.long),
            engine_log_prob=engine_log_prob,
        )
        return batch, int((~keep).sum()), int(zero_groups.sum())
