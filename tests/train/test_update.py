"""One optimizer update: micro-batching must not change it, and BAPO searches the whole update."""

import copy

import pytest
import torch

from bapo.core import BAPOConfig, search_bounds, token_ratio
from bapo.train import Trainer
from bapo.train.rollout import token_log_probs
from bapo.train.update import optimizer_update
from tests.helpers import arithmetic_examples, digit_share, make_config


@pytest.fixture(scope="module")
def stale_setup(tiny_model, tmp_path_factory):
    """A model three updates past the policy that generated `batch` (ratios far from 1)."""
    cfg = make_config(tiny_model, tmp_path_factory.mktemp("run"), **{"optim.lr": 2e-2, "rollout.prompts_per_batch": 6,
                                                                    "loss.method": "bapo",
                                                                    "loss.bapo.target": 0.6})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    old, _ = trainer.rollout_step()
    for _ in range(3):
        trainer.update_step(trainer.rollout_step()[0])
    trainer.close()
    return trainer, old


@pytest.mark.parametrize("method", ["bapo", "grpo"])
def test_micro_batches_give_the_same_update(stale_setup, method):
    trainer, batch = stale_setup
    results = []
    for micro in (len(batch), 5):
        cfg = trainer.cfg.model_copy(deep=True)
        cfg.optim.micro_batch_size, cfg.loss.method = micro, method
        model = copy.deepcopy(trainer.model)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        metrics = optimizer_update(model, opt, sched, batch, cfg)
        delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
        results.append((metrics, delta))
    (full, d_full), (split, d_split) = results
    assert split["lower"] == full["lower"] and split["upper"] == full["upper"]
    assert split["loss"] == pytest.approx(full["loss"], abs=1e-5)
    assert split["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-4)
    torch.testing.assert_close(d_split, d_full, atol=1e-5, rtol=1e-4)
    if method == "bapo":  # bounds of the whole update, not of any one micro-batch
        with torch.no_grad():
            lp, _ = token_log_probs(trainer.model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                    batch.response_mask, trainer.cfg.rollout.temperature)
        found = search_bounds(token_ratio(lp, batch.old_log_prob), batch.advantages, batch.response_mask,
                              BAPOConfig(**trainer.cfg.loss.bapo.model_dump()))
        assert (split["lower"], split["upper"]) == (found.lower, found.upper)
        assert (found.lower, found.upper) != (0.6, 1.2)  # the search moved
        assert split["bapo/search_positive_share"] == pytest.approx(found.positive_share)
