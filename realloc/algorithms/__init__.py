"""RLHF algorithms. The table below names the interface implementations a call may
request with ``interface_impl``; it stays import-light so graph validation does
not load torch."""

from types import MappingProxyType

from realloc.api import InterfaceType as _T

# name -> the interface types it implements
INTERFACE_IMPLS = MappingProxyType({
    "ppo_actor": frozenset({_T.GENERATE, _T.INFERENCE, _T.TRAIN_STEP}),
    "ppo_critic": frozenset({_T.INFERENCE, _T.TRAIN_STEP}),
    "reward": frozenset({_T.INFERENCE}),
    "rule_reward": frozenset({_T.INFERENCE}),
})

# Implementations that need a scalar (value/reward) head rather than the vocabulary head.
VALUE_HEAD_IMPLS = frozenset({"ppo_critic", "reward"})
