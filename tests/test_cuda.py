"""The GPU path on a CUDA device (skipped without one): CUDA-graph decoding against the same step op by op, the
engine in bf16 on the GPU against the CPU engine, and the profiler's GPU timing. benchmarks/gpu_check.py runs
the larger checks (HF parity, a 0.5B model, a GRPO run); these stay small enough for any GPU CI."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU path)")


@pytest.fixture(scope="module")
def groups_for(tmp_path_factory):
    import torch.distributed as dist

    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.strategy import ParallelStrategy

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'pg'}", rank=0,
                                world_size=1)
    cache = ProcessGroupCache()

    def make(cfg):
        layout = ModelLayout.for_model(cfg, (0,), ParallelStrategy(1, 1, 1))
        cache.ensure_layouts([layout])
        return cache.model_groups(layout)
    yield make


def _model(cfg, groups_for, device, dtype, seed=3):
    from realloc.models.engine import ParallelModel

    return ParallelModel(cfg, groups_for(cfg), device=torch.device(device), dtype=dtype, init="random", seed=seed)


def _prompts(n, vocab, lens=(3, 7, 1, 5, 9, 2)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("greedy", [True, False])
def test_cuda_graph_decoding_gives_the_static_steps_tokens_bit_for_bit(groups_for, greedy):
    from realloc.models.config import get_model_config
    from realloc.models.sampling import GenerationConfig

    cfg = get_model_config("small")
    model = _model(cfg, groups_for, "cuda", torch.bfloat16)
    prompts = _prompts(12, cfg.vocab_size)
    base = dict(max_new_tokens=40, min_new_tokens=2, seed=5, eos_token_ids=tuple(range(40, 56)), greedy=greedy)
    out = {m: model.generate(prompts, GenerationConfig(**base, decode=m), n_mbs=2) for m in ("static", "graph")}
    assert torch.equal(out["graph"].sequences, out["static"].sequences)
    assert torch.equal(out["graph"].logprobs, out["static"].logprobs)
    assert torch.equal(out["graph"].stopped_at_eos, out["static"].stopped_at_eos)


def test_bf16_engine_on_the_gpu_stays_within_bf16_of_fp32(groups_for):
    """Same weights in fp32 and bf16 on the GPU (SDPA's flash / memory-efficient kernels): bf16 log-probs
    within bf16 tolerance of fp32, and graph decoding's first greedy tokens equal the eager loop's.
    (gpu_check.py compares both dtypes with transformers on the same GPU.)"""
    from realloc.models.config import get_model_config
    from realloc.models.sampling import GenerationConfig

    cfg = get_model_config("small")
    gpu = _model(cfg, groups_for, "cuda", torch.float32)
    cpu_state = {k: v.detach().cpu() for k, v in gpu.params().items()}
    bf16 = _model(cfg, groups_for, "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (4, 64), generator=g)
    batch = {"input_ids": ids, "lengths": torch.tensor([64, 50, 33, 12])}
    with torch.no_grad():
        for name, p in bf16.params().items():
            p.copy_(cpu_state[name].to(p.device, p.dtype))
    lp32 = gpu.forward(batch, output="logprobs").float().cpu()
    lp16 = bf16.forward(batch, output="logprobs").float().cpu()
    assert (lp16 - lp32).abs().max() < 0.1 * lp32.abs().max()
    gc = GenerationConfig(max_new_tokens=16, min_new_tokens=16, greedy=True)
    a = gpu.generate(_prompts(4, cfg.vocab_size), gc)
    b = gpu.generate(_prompts(4, cfg.vocab_size), GenerationConfig(max_new_tokens=16, min_new_tokens=16,
                                                                   greedy=True, decode="eager"))
    assert torch.equal(a.sequences[:, :8], b.sequences[:, :8])


def test_profiler_times_gpu_work_not_its_launch():
    from realloc.estimator.profiler import timed

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    one = timed(lambda: x @ x, None, 2, 5)
    many = timed(lambda: [x @ x for _ in range(8)], None, 2, 5)
    # launches return at once; with the device synchronized the time grows with the work
    assert many > 4 * one
