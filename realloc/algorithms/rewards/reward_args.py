"""Checks of the reward interfaces' ``interface_args`` (torch-free: ``realloc show`` runs them through
``Interface.check_args`` before anything is planned; the functions in ``reward_fns.py`` run them again)."""

from __future__ import annotations

from typing import Any, Mapping


def check_batch(call: str, args: Mapping[str, Any]) -> None:
    fn = args.get("fn")
    if not callable(fn):
        raise ValueError(f"call {call!r}: batch_reward needs interface_args['fn'], a function (prompts, responses, "
                         f"records, **kwargs) -> one score per sequence, defined in the experiment file or a module "
                         f"it imports; got {fn!r}")


def check_remote(call: str, args: Mapping[str, Any]) -> None:
    from realloc.algorithms.rewards.remote_reward import RemoteReward

    RemoteReward.of(call, args)


def check_mix(call: str, args: Mapping[str, Any]) -> None:
    w = args.get("weights")
    if (not isinstance(w, (list, tuple)) or len(w) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in w)):
        raise ValueError(f"call {call!r}: mix_rewards needs interface_args['weights'], two numbers, one per input "
                         f"key in input_data order (e.g. [0.7, 0.3]); got {w!r}")
