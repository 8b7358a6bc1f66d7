"""Rule-based rewards over token ids."""

import pytest
import torch

from realloc.algorithms.rewards import rule_reward


def test_token_set_fraction_counts_only_valid_response_tokens():
    resp = torch.tensor([[16, 17, 3, 31], [0, 1, 2, 3], [20, 20, 99, 99]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    got = rule_reward.score("rew", {"rule": "token_set", "tokens": list(range(16, 32))}, torch.zeros(3, 2), resp, mask)
    assert got.tolist() == [0.75, 0.0, 1.0]
    empty = rule_reward.score("rew", {"rule": "token_set", "tokens": [1]}, torch.zeros(1, 2),
                              torch.tensor([[1, 1]]), torch.zeros(1, 2, dtype=torch.bool))
    assert empty.tolist() == [0.0]


def test_custom_callable_rule_and_errors():
    def longer_is_better(prompt, resp, mask, scale):
        return mask.sum(1).float() * scale

    got = rule_reward.score("rew", {"rule": longer_is_better, "scale": 0.5}, torch.zeros(2, 1),
                            torch.zeros(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert got.tolist() == [1.0, 1.5]
    with pytest.raises(ValueError, match="rew.*interface_args\\['rule'\\]"):
        rule_reward.resolve_rule("rew", {})
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        rule_reward.resolve_rule("rew", {"rule": "nope"})
    with pytest.raises(ValueError, match="tokens"):
        rule_reward.resolve_rule("rew", {"rule": "token_set"})
    with pytest.raises(ValueError, match="one score per sequence"):
        rule_reward.score("rew", {"rule": lambda p, r, m: torch.zeros(5)}, torch.zeros(2, 1),
                          torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))
