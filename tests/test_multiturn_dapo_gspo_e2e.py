"""DAPO and GSPO on multi-turn rollouts, end to end on the local 2-device CPU cluster (real workers, the sandboxed
calculator in the environment): short runs whose train steps count the policy's tokens only.

Checked from the run's own records, against what the environment said: every rollout is logged
(samples.jsonl), its sampling log-probs are 0 on exactly the environment's tokens (the turn segments), and
DAPO's dynamic sampling keeps exactly the groups whose logged rewards differ and trains the first
``train_prompts`` of them, on the reward the environment gave."""

from __future__ import annotations

import json
import math

from test_multiturn_breadth_e2e import HEAD, _run

COMMON = '''
    seed: int = 1
    dataset: str = DATA + "/calc_train.jsonl"
    tokenizer: str = DATA + "/calc_tokenizer"
    sample_every: int = 1
    log_samples: int = 16
'''
DAPO = HEAD + '''
from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=8, gen_len=24)
@dataclasses.dataclass
class MultiTurnDAPO:''' + COMMON + '''    dapo: DAPOConfig = DAPOConfig(n_minibatches=2, lr=1e-2, train_prompts=2, overlong_buffer=4)

    @property
    def rpcs(self):
        return multiturn_rpcs("dapo", env=ENV, actor="tiny", n_samples=4)
'''
GSPO = HEAD + '''
from realloc.algorithms.critic_free.pg_algorithms import GSPOConfig


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=8, gen_len=24)
@dataclasses.dataclass
class MultiTurnGSPO:''' + COMMON + '''    gspo: GSPOConfig = GSPOConfig(n_minibatches=2, lr=1e-2, kl_coef=0.01)

    @property
    def rpcs(self):
        return multiturn_rpcs("gspo", env=ENV, actor="tiny", n_samples=4)
'''
ONE_DEVICE_GEN = {"*": ("localhost:1", 1, 1, 1, 1), "actor_gen": ("localhost:0", 1, 1, 1, 1)}


def _samples(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def _check_masks(samples: list[dict]) -> None:
    """The sampling log-probs are 0 on the environment's runs and on no token of the policy's."""
    for s in samples:
        assert sum(s["turn_segments"]) == len(s["logp"]) and len(s["turn_segments"]) == 4  # obs, turn, obs, turn
        i = 0
        for k, n in enumerate(s["turn_segments"]):
            part = s["logp"][i:i + n]
            assert all(x == 0 for x in part) if k % 2 == 0 else all(x < 0 for x in part), (k, part)
            i += n


def test_multiturn_dapo_keeps_the_groups_whose_environment_rewards_differ(tmp_path):
    metrics = _run(tmp_path, "dapo", DAPO, ONE_DEVICE_GEN, 2)
    samples = _samples(tmp_path / "dapo")
    assert len(samples) == 2 * 16
    _check_masks(samples)
    for m in metrics:
        it = [s for s in samples if s["iteration"] == m["iteration"]]
        groups = [[s["reward"] for s in it if s["seq"] // 4 == g] for g in range(4)]
        kept = [g for g in groups if max(g) != min(g)]
        train = m["calls"]["actor_train"]
        assert train["groups_kept"] == len(kept) and train["groups_trained"] == min(len(kept), 2)
        trained = [r for g in kept[:2] for r in g]
        assert math.isclose(train["trained_reward"], sum(trained) / max(len(trained), 1), abs_tol=1e-6)
        assert m["calls"]["actor_gen"]["tool_ok"] == 16 and math.isfinite(train["actor_loss"])
    assert metrics[-1]["calls"]["actor_train"]["groups_kept"] > 0


def test_multiturn_gspo_trains_on_the_policy_tokens(tmp_path):
    metrics = _run(tmp_path, "gspo", GSPO, ONE_DEVICE_GEN, 2)
    samples = _samples(tmp_path / "gspo")
    _check_masks(samples)
    for m in metrics:
        train = m["calls"]["actor_train"]
        assert math.isfinite(train["actor_loss"]) and train["actor_grad_norm"] > 0
        assert m["calls"]["actor_gen"]["tool_ok"] == 16
    assert abs(metrics[-1]["kl"]) > 1e-4  # the actor moved away from the reference (k1: either sign)
