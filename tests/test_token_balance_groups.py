"""Token-balanced row lists with groups of responses (issue 31, item 4): DAPO, 4 responses per prompt, dynamic
sampling over the whole batch, every call at dp 2 on long-tailed lengths. The balanced run deals whole groups as
row lists (per mini-batch for the train step) and equals the run that deals equal contiguous rows: samples,
rewards, losses, grad norms, the final checkpoint with the optimizer state (float summation order only)."""

from __future__ import annotations

from test_runtime_e2e import REPO
from test_streaming import assert_same_runs
from test_token_balance import logged_rows, logged_tokens, run_balanced

from realloc.graph.row_deal import deal_rows

N_ITER = 2
EXPERIMENT_FILE = f'''
import dataclasses
import importlib.util

from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig
from realloc.api import ResponseLengths, auto

_spec = importlib.util.spec_from_file_location("dapo_tiny_base", {str(REPO / "experiments/dapo_tiny.py")!r})
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=12, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class Balanced(_base.TinyDAPO):
    dataset: str = {str(REPO / "experiments/data/ppo_tiny_prompts.jsonl")!r}
    dapo: DAPOConfig = DAPOConfig(n_minibatches=2, lr=2e-3, train_prompts=8,
                                  length_schedule=ResponseLengths.lognormal(median=2, p99=7))
    balance_tokens: bool = BALANCE
    sample_every: int = 1
    log_samples: int = 48
'''


def test_dapo_groups_dealt_as_row_lists_match_the_unbalanced_run(tmp_path):
    balanced, even = (run_balanced(tmp_path, EXPERIMENT_FILE, b, N_ITER) for b in (True, False))
    seen = logged_rows(balanced)
    noncontiguous = 0
    for t in range(N_ITER):
        tokens = logged_tokens(balanced, t)
        assert len(tokens) == 48
        train = deal_rows(tokens, 2, unit=4, n_minibatches=2)
        assert seen[t, "actor_train"] == train
        assert seen[t, "ref_inf"] == deal_rows(tokens, 2, unit=4)
        noncontiguous += any(list(r) != list(range(r[0], r[-1] + 1)) for r in train)
    assert noncontiguous  # the groups of some iteration are dealt out of order
    assert_same_runs(balanced, even, N_ITER)


class _Prompts:
    """A dataset of 6 prompts per batch: prompt p of batch t is [t, p, 10 t + p] (realloc.data.prompts' shape)."""

    def batch(self, position, batch_size, seed, prompts):
        import torch

        return {"tokens": torch.tensor([[position, p, 10 * position + p] for p in prompts]).view(-1, 3),
                "lengths": torch.tensor([3] * len(prompts))}

    def batch_rows(self, position, batch_size, seed):
        import torch

        return torch.arange(100 + position * 6, 100 + position * 6 + 6)


def test_dataset_rows_of_a_row_list_are_those_rows_of_the_batch():
    """A call reading a dataset key on a row list (token-balanced, a streamed part) gets exactly its sequences'
    prompts, groups of responses included, as the whole batch's rows at those indices."""
    import torch

    from realloc.runtime.inputs.datasets import dataset_rows, dataset_rows_at

    ds = _Prompts()
    for group in (1, 2, 3):
        n = 6 * group
        whole = dataset_rows(ds, 2, n, 0, 0, n, group)
        for ids in ([0, 1, 5], [1], list(range(n)), [2, 3, 4, n - 1], []):
            got = dataset_rows_at(ds, 2, n, 0, ids, group)
            assert got.keys() == whole.keys()
            for k, v in whole.items():
                assert torch.equal(got[k], v[ids]), (group, ids, k)
