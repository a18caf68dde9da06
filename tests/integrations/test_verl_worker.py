"""BAPOTrainingWorker through verl's real actor update path, on CPU, 2 data-parallel ranks (gloo).

verl 0.9's FSDP engine is registered for cuda/npu only (and its `get_device_id` needs CUDA), so
the ranks run verl's own `TrainingWorker.train_mini_batch` -> `BAPOTrainingWorker.train_batch`
-> `BaseEngine.train_batch` / `BaseEngine.infer_batch` -> `ppo_loss` -> the registered `bapo` loss,
with `CPUEngine` below in place of `FSDPEngine`: it follows FSDPEngine.forward_backward_batch
(global token count, verl's `prepare_micro_batches` with dynamic batch sizes) around a tiny
random Qwen2 built from a config, and averages gradients over ranks in its optimizer step as
FSDP would. The ranks hold different shards (short answers on rank 0, long on rank 1): in the
no-grad bound pre-pass each keeps its own micro-batch count, so a collective issued per
micro-batch there would hang the run (the training pass equalises counts, as FSDPEngine does).
"""

import os
import socket
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("transformers")
pytest.importorskip("verl.workers.engine_workers")  # needs verl's worker deps (ray, fastapi, uvicorn)
pytestmark = [pytest.mark.slow, pytest.mark.verl]  # two spawned gloo ranks running verl's worker (.venv-verl)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.base import BaseEngine  # noqa: E402
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

PROMPT, RESPONSE, VOCAB = 3, 12, 48
PER_RANK, MINI_BATCH, EPOCHS = 8, 8, 2  # 2 mini-batches of 4 per rank per epoch: 4 optimizer steps
# Rank 0 answers short, rank 1 long: with these token budgets their micro-batch counts differ.
RESPONSE_LENGTHS = ([2, 3, 4, 2, 3, 4, 2, 3], [12, 10, 11, 9, 12, 10, 11, 9])
TRAIN_TOKENS, PROBE_TOKENS = 16, 32
LOSS_CONFIG = {
    "_target_": "bapo.integrations.verl.BAPOPolicyLossConfig",
    "loss_mode": "bapo",
    "target": 0.6,
    "lower_step": 0.05,
    "upper_step": 0.1,
}

# target_mode=entropy: rho0 held for the first update, then steered hard enough to move each step
ENTROPY_TARGET = {"target_mode": "entropy", "target_hold_updates": 1, "target_gain": 2.0, "target_integral_gain": 0.5}


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Qwen2 (hidden 32), float64, built locally from a config (no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config).double()


def sequence_outputs(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's no-padding model outputs, each nested [B, j] like input_ids: log_probs (entry i =
    log p(token i+1 | tokens <= i)) and entropy (entry i = entropy of the distribution at i)."""
    log_probs, entropies = [], []
    for ids in input_ids.unbind():
        log_softmax = torch.log_softmax(model(input_ids=ids[None]).logits[0], -1)  # [j, V]
        next_ids = torch.roll(ids, -1)
        log_probs.append(log_softmax.gather(-1, next_ids[:, None]).squeeze(-1))
        entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))
    return {
        name: torch.nested.as_nested_tensor(values, layout=torch.jagged)
        for name, values in (("log_probs", log_probs), ("entropy", entropies))
    }


class CPUEngine(BaseEngine):
    """verl BaseEngine on CPU for tests: FSDPEngine.forward_backward_batch's steps, a plain module."""

    def __init__(self, module: torch.nn.Module, group, lr: float = 0.5):
        self.module, self.group = module, group
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr)
        self.probe_micro_batch_counts: list[int] = []  # per no-grad forward_backward_batch call
        self.mode = None

    is_param_offload_enabled = property(lambda self: False)
    is_optimizer_offload_enabled = property(lambda self: False)

    def train_mode(self, **kwargs):
        return nullcontext()

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_size(self):
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self):
        return dist.get_rank(self.group)

    def is_mp_src_rank_with_outputs(self):
        return True

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad()

    def optimizer_step(self):
        """Average gradients over the DP group (what FSDP's reduce-scatter does), then step."""
        grads = [p.grad for p in self.module.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.get_data_parallel_size()
        torch.nn.utils.vector_to_parameters(flat, grads)  # writes the averaged values back into .grad
        grad_norm = flat.norm()
        self.optimizer.step()
        return grad_norm

    def lr_scheduler_step(self):
        return self.optimizer.param_groups[0]["lr"]

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save(state, os.path.join(local_path, f"engine_rank{dist.get_rank()}.pt"))

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        state = torch.load(os.path.join(local_path, f"engine_rank{dist.get_rank()}.pt"))
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def split(self, data: TensorDict, same_count_on_all_ranks: bool):
        """verl's dynamic-batch-size micro-batches. FSDPEngine asks for the same count on every rank
        (same_micro_num_in_dp=True, needed by TrainingWorker's metric aggregation); its all-reduce
        wants an accelerator, so it is done here. The no-grad pass keeps each rank's own count."""
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.group, same_micro_num_in_dp=False)
        if not same_count_on_all_ranks:
            return micro_batches, indices
        count = torch.tensor(len(micro_batches))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return prepare_micro_batches(
            data=data, dp_group=self.group, same_micro_num_in_dp=False, min_num_micro_batch=int(count)
        )

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        tu.assign_non_tensor(data, sp_size=1)
        batch_num_tokens = data["loss_mask"].sum()
        dist.all_reduce(batch_num_tokens, group=self.group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size())
        micro_batches, indices = self.split(data, same_count_on_all_ranks=not forward_only)
        if forward_only:
            self.probe_micro_batch_counts.append(len(micro_batches))
        outputs = []
        for micro_batch in micro_batches:
            model_output = sequence_outputs(self.module, micro_batch["input_ids"])
            if not tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):
                del model_output["entropy"]  # as verl's engines: entropy only when asked for
            loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=self.group)
            if not forward_only:
                loss.backward()
            log_probs = model_output["log_probs"].detach()
            outputs.append({"model_output": {"log_probs": log_probs}, "loss": loss.item(), "metrics": metrics})
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)


def make_shard(rank: int, model: torch.nn.Module) -> TensorDict:
    """One rank's rollout batch, left-right padded as verl's trainer holds it.

    old_log_probs: the model's log-probs plus noise (a stale behaviour policy), [PER_RANK, RESPONSE];
    advantages: +1 / -1 per sequence, alternating.
    """
    generator = torch.Generator().manual_seed(100 + rank)
    lengths = torch.tensor(RESPONSE_LENGTHS[rank])
    prompts = torch.randint(1, VOCAB, (PER_RANK, PROMPT), generator=generator)
    response_mask = (torch.arange(RESPONSE)[None, :] < lengths[:, None]).long()
    responses = torch.randint(1, VOCAB, (PER_RANK, RESPONSE), generator=generator) * response_mask
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompts), response_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        token_log_probs = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    current = token_log_probs[:, PROMPT - 1 :]
    old_log_probs = (
        current + 0.6 * torch.randn(current.shape, generator=generator, dtype=current.dtype)
    ) * response_mask
    advantages = torch.where(torch.arange(PER_RANK) % 2 == 0, 1.0, -1.0).double()[:, None] * response_mask
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp_min(0),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "advantages": advantages,
        },
        batch_size=[PER_RANK],
    )


def no_padding(batch: TensorDict) -> TensorDict:
    """verl's layout for update_actor (what the trainer does before sending the batch)."""
    return left_right_2_no_padding(batch.clone())


def interleave(shards: list[TensorDict], per_rank_mini_batch: int) -> TensorDict:
    """The concatenation whose k-th global mini-batch is every rank's k-th mini-batch."""
    pieces = [
        shard[start : start + per_rank_mini_batch]
        for start in range(0, PER_RANK, per_rank_mini_batch)
        for shard in shards
    ]
    return torch.cat(pieces, dim=0)


def make_worker(group, model, scope: str = "step", dynamic_batch_size: bool = True, **loss_config):
    """BAPOTrainingWorker wired as ActorRolloutRefWorker.init_model wires it, minus Ray and FSDP."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.profiler import DistProfiler
    from verl.workers.utils.losses import ppo_loss

    import bapo.integrations.verl.worker as bapo_worker

    class RecordingWorker(bapo_worker.BAPOTrainingWorker):
        def solve_bounds(self, data, step):
            found = super().solve_bounds(data, step)
            self.solved.append(found)
            return found

    actor_config = omega_conf_to_dataclass(
        OmegaConf.create(
            {  # Hydra instantiation, as init_model does
                "_target_": "verl.workers.config.FSDPActorConfig",
                "strategy": "fsdp",
                "ppo_mini_batch_size": MINI_BATCH,
                "use_dynamic_bsz": True,
                "ppo_max_token_len_per_gpu": TRAIN_TOKENS,
                "rollout_n": 1,
                "policy_loss": {**LOSS_CONFIG, "scope": scope, **loss_config},
            }
        )
    )
    worker = RecordingWorker.__new__(RecordingWorker)  # TrainingWorker.__init__ needs Ray and an engine registry
    worker.engine = CPUEngine(model, group)
    worker.engine_config = OmegaConf.create(
        {
            "use_dynamic_bsz": dynamic_batch_size,
            "max_token_len_per_gpu": TRAIN_TOKENS,
            "micro_batch_size_per_gpu": None if dynamic_batch_size else 2,
            "infer_max_token_len_per_gpu": PROBE_TOKENS,
            "infer_micro_batch_size_per_gpu": None,
            "use_fused_kernels": False,
            "forward_only": False,
        }
    )
    worker.model_config = {}
    worker.device_name = "cpu"
    worker.flops_counter = None
    worker.profiler = DistProfiler(rank=dist.get_rank())
    worker.loss_fn = partial(ppo_loss, config=actor_config)
    worker.solved = []
    return worker


def train(worker, data: TensorDict):
    tu.assign_non_tensor(
        data,
        mini_batch_size=MINI_BATCH,
        global_batch_size=MINI_BATCH,
        epochs=EPOCHS,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        calculate_entropy=False,
    )
    return tu.get(worker.train_mini_batch(data), "metrics")


def rank_main(rank: int, world_size: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=90))
    import verl.workers.engine_workers as engine_workers

    # TrainingWorker._postprocess_output logs accelerator memory; there is no accelerator here.
    no_device = SimpleNamespace(max_memory_allocated=lambda: 0, max_memory_reserved=lambda: 0)
    engine_workers.get_torch_device = lambda: no_device
    shards = [make_shard(r, tiny_qwen2()) for r in range(world_size)]
    all_reduces = count_calls(dist, "all_reduce")

    worker = make_worker(dist.group.WORLD, tiny_qwen2())
    metrics = train(worker, no_padding(shards[rank]))
    result = {
        "solved": worker.solved,
        "probe_micro_batch_counts": worker.engine.probe_micro_batch_counts,
        "all_reduces": all_reduces.count,
        "metrics": {k: v for k, v in metrics.items() if k.startswith("actor/") or k in ("loss", "grad_norm")},
    }

    # scope micro_batch: no pre-pass; CPUEngine gives every rank the same micro-batch count in
    # training (as FSDPEngine does), which a run without dynamic batch sizes guarantees
    micro_worker = make_worker(dist.group.WORLD, tiny_qwen2(), scope="micro_batch", dynamic_batch_size=False)
    before = all_reduces.count
    micro_metrics = train(micro_worker, no_padding(shards[rank]))
    result["micro"] = {
        "metrics": {k: v for k, v in micro_metrics.items() if k.startswith("actor/bapo/search/")},
        "all_reduces": all_reduces.count - before,
        "probes": len(micro_worker.engine.probe_micro_batch_counts),
        "solved": micro_worker.solved,
    }
    try:
        train(make_worker(dist.group.WORLD, tiny_qwen2(), scope="micro_batch"), no_padding(shards[rank]))
    except ValueError as error:
        result["micro_refusal"] = str(error)

    result["entropy"] = entropy_target_runs(shards, rank, out_dir)

    alone = dist.new_group([0])  # every rank takes part in creating it; only rank 0 uses it
    if rank == 0:
        reference = make_worker(alone, tiny_qwen2())
        train(reference, no_padding(interleave(shards, MINI_BATCH // world_size)))
        result["reference_solved"] = reference.solved
        result["first_step_direct"] = direct_search(shards, MINI_BATCH // world_size)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def entropy_target_runs(shards: list[TensorDict], rank: int, out_dir: str) -> dict:
    """target_mode=entropy: two rollout batches straight (8 optimizer steps), and the same run
    split by a checkpoint into a fresh worker with other initial weights."""
    from bapo.core import BAPOStep
    from bapo.core.target import EntropyTargetController

    class RecordingController(EntropyTargetController):
        def __init__(self, config):
            super().__init__(config)
            self.fed: list[float] = []

        def update(self, entropy: float) -> float:
            self.fed.append(entropy)
            return super().update(entropy)

    def entropy_worker(seed: int = 0):
        worker = make_worker(dist.group.WORLD, tiny_qwen2(seed), **ENTROPY_TARGET)
        config = worker.loss_fn.keywords["config"].policy_loss.bapo_config()
        group = worker.engine.get_data_parallel_group()
        worker.bapo_step = BAPOStep(config, device="cpu", process_group=group, controller=RecordingController(config))
        return worker

    straight = entropy_worker()
    straight_targets = [
        target for _ in range(2) for target in train(straight, no_padding(shards[rank]))["actor/bapo/target"]
    ]
    first_half = entropy_worker()
    train(first_half, no_padding(shards[rank]))
    checkpoint = os.path.join(out_dir, "checkpoint")
    first_half.save_checkpoint(checkpoint)
    dist.barrier()
    resumed = entropy_worker(seed=1)  # the checkpoint must bring back the weights as well
    resumed.load_checkpoint(checkpoint)
    resumed_targets = train(resumed, no_padding(shards[rank]))["actor/bapo/target"]
    return {
        "fed": straight.bapo_step.controller.fed,
        "targets": straight_targets,
        "state": straight.bapo_step.state_dict(),
        "config": straight.bapo_step.config,
        "resumed_fed": resumed.bapo_step.controller.fed,
        "resumed_targets": resumed_targets,
        "resumed_state": resumed.bapo_step.state_dict(),
        "checkpoint_files": sorted(os.listdir(checkpoint)),
        "first_step_direct": direct_entropy(shards, MINI_BATCH // 2) if rank == 0 else None,
    }


def direct_entropy(shards: list[TensorDict], per_rank_mini_batch: int) -> float:
    """Token-mean entropy of every rank's first mini-batch at the initial weights, in one process."""
    from verl.workers.utils.padding import no_padding_2_padding

    model, total, count = tiny_qwen2(), 0.0, 0.0
    for shard in shards:
        first = no_padding(shard[:per_rank_mini_batch])
        with torch.no_grad():
            entropy = no_padding_2_padding(sequence_outputs(model, first["input_ids"])["entropy"], first)
        mask = first.select("response_mask").to_padded_tensor()["response_mask"]
        total, count = total + float((entropy * mask).sum()), count + float(mask.sum())
    return total / count


def count_calls(module, name: str) -> SimpleNamespace:
    """Count calls of module.name from now on (every caller looks it up at call time)."""
    counter, original = SimpleNamespace(count=0), getattr(module, name)

    def counted(*args, **kwargs):
        counter.count += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return counter


def direct_search(shards: list[TensorDict], per_rank_mini_batch: int):
    """bapo.core.search_bounds on every rank's first mini-batch, at the initial weights, in one process."""
    from verl.workers.utils.padding import no_padding_2_padding

    from bapo.core import TokenBatch, search_bounds, token_ratio
    from bapo.integrations.verl import BAPOPolicyLossConfig

    model, pieces = tiny_qwen2(), []
    for shard in shards:
        first = no_padding(shard[:per_rank_mini_batch])
        with torch.no_grad():
            log_prob = no_padding_2_padding(sequence_outputs(model, first["input_ids"])["log_probs"], first)
        tokens = first.select("old_log_probs", "advantages", "response_mask").to_padded_tensor()
        pieces.append((token_ratio(log_prob, tokens["old_log_probs"]), tokens["advantages"], tokens["response_mask"]))
    ratio, advantages, mask = (torch.cat(parts) for parts in zip(*pieces))
    config = BAPOPolicyLossConfig(**{k: v for k, v in LOSS_CONFIG.items() if k != "_target_"}).bapo_config()
    return search_bounds(TokenBatch(ratio=ratio, advantages=advantages, mask=mask.bool()), config)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("verl_dp"))
    mp.start_processes(rank_main, args=(2, free_port(), out_dir), nprocs=2, join=True, start_method="spawn")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def test_ranks_run_different_micro_batch_counts_in_the_pre_pass(ranks):
    counts = [rank["probe_micro_batch_counts"] for rank in ranks]
    assert len(counts[0]) == len(counts[1]) == 4  # one pre-pass per optimizer step
    assert all(short < long for short, long in zip(*counts))


def test_ranks_issue_the_same_collectives(ranks):
    assert ranks[0]["all_reduces"] == ranks[1]["all_reduces"]


def test_every_rank_gets_the_same_bounds_each_step(ranks):
    assert len(ranks[0]["solved"]) == EPOCHS * PER_RANK // (MINI_BATCH // 2) == 4
    assert ranks[0]["solved"] == ranks[1]["solved"]
    assert len({(s.lower, s.upper) for s in ranks[0]["solved"]}) > 1 or ranks[0]["solved"][0].steps > 0


def test_bounds_equal_one_process_on_the_concatenation(ranks):
    reference = ranks[0]["reference_solved"]
    assert [(s.lower, s.upper) for s in ranks[0]["solved"]] == [(s.lower, s.upper) for s in reference]
    for dp, alone in zip(ranks[0]["solved"], reference):
        assert dp.positive_share == pytest.approx(alone.positive_share, rel=1e-6)  # weights differ by rounding
    direct = ranks[0]["first_step_direct"]
    assert (direct.lower, direct.upper) == (reference[0].lower, reference[0].upper)
    assert direct.positive_share == pytest.approx(reference[0].positive_share, rel=1e-9)


def test_update_logs_bapo_metrics_under_verl_names(ranks):
    metrics = ranks[0]["metrics"]
    solved = ranks[0]["solved"]
    assert metrics["actor/bapo/lower"] == pytest.approx([s.lower for s in solved])
    assert metrics["actor/bapo/upper"] == pytest.approx([s.upper for s in solved])
    assert metrics["actor/bapo/search/share"] == pytest.approx([s.positive_share for s in solved])
    assert metrics["actor/bapo/search/scope"] == pytest.approx([0.0] * len(solved))
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/bapo/clip_frac/upper", "grad_norm"):
        assert all(torch.isfinite(torch.tensor(metrics[key]))), key


def test_micro_batch_scope_solves_per_micro_batch_consistently_across_ranks(ranks):
    micro = [rank["micro"] for rank in ranks]
    assert micro[0]["probes"] == 0 and micro[0]["solved"] == []  # no pre-pass, no step search
    lower, upper = micro[0]["metrics"]["actor/bapo/search/lower"], micro[0]["metrics"]["actor/bapo/search/upper"]
    assert lower == micro[1]["metrics"]["actor/bapo/search/lower"]  # one all-reduce per micro-batch: same bounds
    assert upper == micro[1]["metrics"]["actor/bapo/search/upper"]
    assert all(scope == 1.0 for scope in micro[0]["metrics"]["actor/bapo/search/scope"])
    assert micro[0]["all_reduces"] == micro[1]["all_reduces"]
    # per micro-batch bounds move between micro-batches (not one value for the step)
    assert len(set(zip(lower, upper))) > 1


def test_micro_batch_scope_refuses_dynamic_batch_sizes(ranks):
    assert "use_dynamic_bsz" in ranks[0]["micro_refusal"]


def test_entropy_target_is_fed_the_same_all_rank_entropy_on_every_rank(ranks):
    fed = [rank["entropy"]["fed"] for rank in ranks]
    assert len(fed[0]) == 8 and fed[0] == fed[1]  # one all-reduced value per optimizer step
    assert all(value > 0 for value in fed[0])
    # the first step's entropy is the token mean over both ranks' first mini-batches
    assert fed[0][0] == pytest.approx(ranks[0]["entropy"]["first_step_direct"], rel=1e-9)


def test_entropy_target_sets_each_steps_rho0_from_the_last_steps_entropy(ranks):
    from bapo.core.target import EntropyTargetController

    run = ranks[0]["entropy"]
    controller = EntropyTargetController(run["config"])
    expected = [run["config"].target] + [controller.update(entropy) for entropy in run["fed"][:-1]]
    assert run["targets"] == pytest.approx(expected, abs=1e-12)  # actor/bapo/target, per step
    assert len({round(target, 9) for target in run["targets"]}) > 3  # the controller moved rho0
    assert ranks[1]["entropy"]["targets"] == run["targets"]


def test_entropy_target_resumes_exactly_from_a_checkpoint(ranks):
    for rank, run in enumerate(ranks):
        run = run["entropy"]
        assert f"bapo_step_rank{rank}.json" in run["checkpoint_files"]
        assert run["resumed_state"] == run["state"]  # 4 + resume + 4 == 8 straight
        assert run["resumed_fed"] == run["fed"][4:]
        assert run["resumed_targets"] == run["targets"][4:]


def test_entropy_target_resume_without_saved_state_warns_and_starts_afresh(tmp_path):
    """A checkpoint saved without controller state (a fixed-target run): one warning naming the
    directory; the controller then starts from policy_loss.target. One process, no collectives."""
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from bapo.core import MissingStepStateWarning
    from bapo.integrations.verl import BAPOPolicyLossConfig
    from bapo.integrations.verl.worker import BAPOTrainingWorker

    policy_loss = BAPOPolicyLossConfig(**{k: v for k, v in LOSS_CONFIG.items() if k != "_target_"}, **ENTROPY_TARGET)
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1, policy_loss=policy_loss
    )
    worker = BAPOTrainingWorker.__new__(BAPOTrainingWorker)
    worker.engine = SimpleNamespace(load_checkpoint=lambda *args: None, get_data_parallel_group=lambda: None)
    worker.loss_fn = partial(ppo_loss, config=config)
    with pytest.warns(MissingStepStateWarning) as warned:
        worker.load_checkpoint(str(tmp_path))
    assert len(warned) == 1 and str(tmp_path) in str(warned[0].message)
    assert "no entropy-controller state" in str(warned[0].message)
    assert worker.step_for(policy_loss).controller.state_dict()["target"] == LOSS_CONFIG["target"]


def test_plugin_import_installs_the_worker_after_verl_loads_its_workers():
    """Importing bapo.integrations.verl (verl's plugin entry point) before verl's worker module
    makes ActorRolloutRefWorker build BAPOTrainingWorker once that module loads; building a
    BAPOPolicyLossConfig no longer installs anything."""
    import subprocess
    import sys

    code = (
        "import sys, bapo.integrations.verl\n"
        "assert 'verl.workers.engine_workers' not in sys.modules\n"
        "from bapo.integrations.verl import BAPOPolicyLossConfig\n"
        "BAPOPolicyLossConfig()\n"
        "import verl.workers.engine_workers as ew\n"
        "from bapo.integrations.verl.worker import BAPOTrainingWorker\n"
        "assert ew.ActorRolloutRefWorker.actor_worker_cls is BAPOTrainingWorker\n"
    )
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


def test_pre_pass_and_loss_get_the_same_rollout_weights(monkeypatch):
    """verl's rollout correction (rollout_is_weights, e.g. IcePop's "0.5_5.0" in decoupled mode,
    where old_log_probs are recomputed and the behaviour gap sits in the weights): the worker's
    bound pre-pass (observe_micro_batch) and the registered loss, through verl's own ppo_loss,
    hand BAPO's search and the loss the same per-token weights. One process, no collectives."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.workers.utils.losses import ppo_loss

    import bapo.integrations.verl.losses as verl_losses
    from bapo.core import BAPOStep
    from bapo.integrations.verl import BAPOPolicyLossConfig
    from bapo.integrations.verl.worker import observe_micro_batch
    from tests.integrations.test_verl_losses import actor_config

    model = tiny_qwen2()
    shard = make_shard(1, model)
    generator = torch.Generator().manual_seed(3)
    mask = shard["response_mask"]
    rollout_log_prob = shard["old_log_probs"] + 0.8 * torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    weights, _ = compute_rollout_correction_weights(
        (shard["old_log_probs"] - rollout_log_prob) * mask, mask, rollout_is="token", rollout_is_threshold="0.5_5.0"
    )
    assert 0 < int(((weights == 0) & mask.bool()).sum()) < int(mask.sum())  # IcePop zeroes some tokens
    shard["rollout_is_weights"] = weights
    data = no_padding(shard)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=None)
    seen: dict[str, list] = {"observe": [], "bounds_for": [], "loss": []}
    real = {"observe": BAPOStep.observe, "bounds_for": BAPOStep.bounds_for, "loss": verl_losses.policy_loss}

    def spy(name, weights_of):
        def call(*args, **kwargs):
            seen[name].append(weights_of(args, kwargs))
            return real[name](*args, **kwargs)

        return call

    def batch_weights(args, kwargs):  # BAPOStep.observe / bounds_for(self, batch)
        return args[1].importance_weights

    monkeypatch.setattr(BAPOStep, "observe", spy("observe", batch_weights))
    monkeypatch.setattr(BAPOStep, "bounds_for", spy("bounds_for", batch_weights))
    monkeypatch.setattr(verl_losses, "policy_loss", spy("loss", lambda args, kwargs: kwargs.get("importance_weights")))
    policy_loss_config = BAPOPolicyLossConfig(**{k: v for k, v in LOSS_CONFIG.items() if k != "_target_"})
    config = actor_config("token-mean", policy_loss_config, {})
    step = BAPOStep(policy_loss_config.bapo_config())
    step.begin(micro_batches=1)
    outputs = sequence_outputs(model, data["input_ids"])
    observe_micro_batch(outputs, data, step=step)
    step.solve()
    policy_loss_config.attach_step(step)
    ppo_loss(config=config, model_output=sequence_outputs(model, data["input_ids"]), data=data)
    for name, calls in seen.items():
        assert len(calls) == 1, name
        torch.testing.assert_close(calls[0].double(), weights, msg=name)
