"""rollout.backend=vllm: a colocated `vllm.LLM` in the trainer's own process.

Only bapo.train.rollout imports this module, and only at the first vLLM generation pass, so
nothing else in bapo needs vLLM installed (`pip install bapo[vllm]`).

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the trainer can reach
its model. Before a pass that samples with policy version v, `sync` pushes the trainer's
weights when the engine holds another version (once per version: partial rollout's several
passes of one step, and FIFO warm-up, push nothing new), through the model runner's
`reload_weights` (vLLM's layer-wise reload: every weight restored to checkpoint format, loaded,
then processed again). On CPU vLLM packs each linear weight into a oneDNN / sgl-kernel handle
after loading; with tied embeddings (SmolLM2, the tiny Llama) the LM head shares the embedding
and its packed copy would stay that of the previous version, so `sync` re-ties the head to the
freshly loaded embedding and packs it again.

Sampling: one request per row with its own token budget, the config's temperature / top-k /
top-p, the stop token ids (EOS) and stop strings, and a per-request seed drawn from torch's
global generator (checkpointed with the run, so a resume draws the same seeds). vLLM returns
the log-prob of each sampled token under logits / T (logprobs_mode=processed_logprobs; with
top-k/top-p: of the truncated distribution it really drew from).
"""

from __future__ import annotations

import math
import os
import time

import torch

from bapo.train.checkpoint import rng_state, set_rng_state
from bapo.train.lora import merged_weights
from bapo.train.sampling import Sampled, SamplingParams


def _engine_dtype(cfg, model) -> str:
    if cfg.rollout.vllm_dtype != "auto":
        return cfg.rollout.vllm_dtype
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _max_model_len(cfg, model) -> int:
    """Prompt + response, within the model's own position limit."""
    wanted = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens + 8
    limit = getattr(model.config, "max_position_embeddings", None)
    return min(wanted, limit) if isinstance(limit, int) and limit > 0 else wanted


class VLLMEngine:
    """A vllm.LLM holding the trainer's weights of `self.version`."""

    def __init__(self, cfg, model, tokenizer):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the push reaches the model
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(cfg.rollout.vllm_kv_cache_gb))))
        try:
            from vllm import LLM
        except ImportError:  # a Trainer built directly (train() checks before any work)
            from bapo.train.config import ConfigError, vllm_missing

            missing = vllm_missing()
            if missing is None:  # installed but broken: its own error says more
                raise
            raise ConfigError(missing) from None

        self.cfg, self.rollout_cfg = cfg, cfg.rollout
        self.version: int | None = None  # nothing pushed yet: the first pass always pushes
        self.push_seconds = 0.0
        self.pushes = 0
        self.sample_seconds = 0.0  # in llm.generate, over the run
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        started = time.perf_counter()
        # vLLM seeds python / numpy / torch's global generators with `seed` while it starts; the
        # run's own draws (sampling seeds, prompt order) must go on from where they were, or a
        # resumed run, whose engine starts later, would draw other seeds than an unbroken one
        run_rng = rng_state()
        try:
            self.llm = LLM(
                model=cfg.model.path,
                tokenizer=cfg.model.path,
                dtype=_engine_dtype(cfg, model),
                seed=cfg.run.seed,
                max_model_len=_max_model_len(cfg, model),
                logprobs_mode="processed_logprobs",
                enforce_eager=cfg.rollout.vllm_enforce_eager,
                gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
                trust_remote_code=cfg.model.trust_remote_code,
                enable_prefix_caching=False,  # a cached prefix would hold the K/V of an older version
            )
        finally:
            set_rng_state(run_rng)
        self.start_seconds = time.perf_counter() - started

    def close(self) -> None:
        """Shut the in-process engine down (its executor and KV cache) and drop it."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        try:
            if core is not None:
                core.shutdown()
        finally:
            self.llm = None

    # -- weights ----------------------------------------------------------------------------
    def sync(self, model, version: int) -> bool:
        """Push `model`'s weights unless the engine already holds `version`; True when pushed."""
        if self.version == version:
            return False
        started = time.perf_counter()
        # LoRA (model.lora): the merged weights W + scale * B @ A under the base's names, so the engine
        # samples from the current adapted policy; the trained model is not merged in place
        push_weights(self.llm, list(merged_weights(model).items()), self.tied)
        self.version = version
        self.pushes += 1
        self.push_seconds += time.perf_counter() - started
        return True

    # -- sampling ---------------------------------------------------------------------------
    def sample(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        params: SamplingParams,
        eos_ids: list[int],
        pad_id: int,
    ) -> Sampled:
        """Up to budgets[i] new tokens after each context (prompt + response so far): tokens
        [n, max budget] padded with pad_id, and the engine's log-prob of each [n, max budget]."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        seeds = torch.randint(0, 2**31 - 1, (len(contexts),)).tolist()
        requests = [
            VLLMSamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else 0,
                max_tokens=budget,
                min_tokens=0,
                stop_token_ids=list(eos_ids),
                stop=list(self.rollout_cfg.stop) or None,
                include_stop_str_in_output=True,
                seed=seed,
                logprobs=0,
                detokenize=bool(self.rollout_cfg.stop),
                repetition_penalty=1.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                min_p=0.0,
            )
            for budget, seed in zip(budgets, seeds)
        ]
        started = time.perf_counter()
        outputs = []
        # vLLM on CPU cannot rewind a seeded request's generator (set_offset), which it does when a
        # prefill is split across scheduler steps (chunked prefill): send at most as many requests
        # at once as the first step prefills whole
        for start in range(0, len(contexts), rows := self._rows_per_call(contexts)):
            outputs += self.llm.generate(
                [TokensPrompt(prompt_token_ids=context) for context in contexts[start : start + rows]],
                requests[start : start + rows],
                use_tqdm=False,
            )
        self.sample_seconds += time.perf_counter() - started
        width = max(budgets, default=0)
        tokens = torch.full((len(contexts), width), pad_id, dtype=torch.long)
        log_prob = torch.zeros((len(contexts), width), dtype=torch.float32)
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            ids = list(completion.token_ids)[:width]
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            for col, (token, entry) in enumerate(zip(ids, completion.logprobs or [])):
                log_prob[row, col] = float(entry[token].logprob)
        return Sampled(tokens, log_prob)

    def _rows_per_call(self, contexts: list[list[int]]) -> int:
        """Requests one generate call may take so that the scheduler's first step prefills each whole:
        the token budget of a step over the longest context, and at most max_num_seqs."""
        scheduler = getattr(getattr(self.llm.llm_engine, "vllm_config", None), "scheduler_config", None)
        if scheduler is None:  # another vLLM layout: its defaults (CPU: 4096 tokens, 256 sequences)
            return max(1, min(256, 4096 // max(max((len(c) for c in contexts), default=1), 1)))
        longest = max((len(context) for context in contexts), default=1)
        return max(1, min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens // max(longest, 1)))


def push_weights(llm, weights: list[tuple[str, torch.Tensor]], tied: bool) -> None:
    """Load (name, tensor) pairs in Hugging Face names into an in-process `llm` through the model
    runner's layer-wise `reload_weights` (which restores, loads and re-processes every layer, so
    it also works where vLLM packed the weights after loading, e.g. on CPU), then re-tie and
    re-pack a tied LM head. Also used by bapo.integrations.trl for TRL's colocate mode on CPU."""

    def push(worker):
        runner = worker.model_runner
        runner.reload_weights(weights_iterator=iter(weights))
        if tied:
            _retie_lm_head(runner.get_model())

    llm.collective_rpc(push)


def _retie_lm_head(vllm_model) -> None:
    """Tied embeddings: the LM head takes the embedding just loaded, and on CPU its packed GEMM
    handle is rebuilt from it (otherwise the head keeps the previous version's packed copy)."""
    head = getattr(vllm_model, "lm_head", None)
    embed = getattr(getattr(vllm_model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        return
    head.weight = embed.weight
    if hasattr(head, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
