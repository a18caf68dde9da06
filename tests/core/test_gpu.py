"""CUDA checks of the core (skipped without a GPU; run them with scripts/gpu_check.sh)."""

import pytest
import torch

from bapo.core import BAPOConfig, TokenBatch, policy_loss, search_bounds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_search_and_losses_on_cuda_match_cpu(dtype):
    generator = torch.Generator().manual_seed(0)
    ratio = torch.exp(0.5 * torch.randn(64, 256, generator=generator)).to(dtype)
    advantages = torch.randn(64, generator=generator).to(dtype)
    mask = torch.rand(64, 256, generator=generator) > 0.2
    cfg = BAPOConfig(target=0.5, lower_step=0.05)
    batch = TokenBatch(ratio=ratio, advantages=advantages, mask=mask)
    on_cuda = TokenBatch(ratio=ratio.cuda(), advantages=advantages.cuda(), mask=mask.cuda())
    assert search_bounds(on_cuda, cfg) == search_bounds(batch, cfg)
    log_prob = ratio.float().log()
    for method in ("grpo", "bapo", "dcpo", "topr"):
        params = {"bounds": search_bounds(batch, cfg)} if method == "bapo" else {}
        cpu_loss, cpu_metrics = policy_loss(
            log_prob, torch.zeros_like(log_prob), advantages.float(), mask, method, **params
        )
        gpu_loss, gpu_metrics = policy_loss(
            log_prob.cuda(), torch.zeros_like(log_prob).cuda(), advantages.float().cuda(), mask.cuda(), method, **params
        )
        assert float(gpu_loss) == pytest.approx(float(cpu_loss), rel=1e-4, abs=1e-6)
        assert gpu_metrics["upper"] == pytest.approx(cpu_metrics["upper"], rel=1e-5)
