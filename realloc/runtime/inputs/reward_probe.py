"""`realloc show` calls each reward the user brings on the first dataset record, before anything runs.

A reward function that raises (a misspelt record field, a parse of the response that fails) or a reward service
that is not there otherwise shows up only after the workers have loaded their models and generated a batch
(minutes on a busy machine). Here the first record's prompt goes to the reward with an empty response (a
response that ends at once: EOS first, which any run can produce) and the one score must come back::

    for line in probe_rewards(spec, dataset, tokenizer):
        print(line)   # "reward rew_inf: score(first record, empty response) = 0.0"

A service is asked once more at most, with a timeout of at most ``PROBE_TIMEOUT`` seconds, so a wrong URL fails in
seconds; its reply is only numbers, as in a run. A service that does not answer within that, where the call's own
``timeout`` is longer, is reported as not checked rather than refused: the run would wait for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from realloc import user_code
from realloc.api import ExperimentSpec

PROBED = ("batch_reward", "remote_reward")  # the rewards whose code or service is the user's
PROBE_TIMEOUT = 10.0  # seconds per request to a reward service


def probe_rewards(spec: ExperimentSpec, dataset: Any, tokenizer: Any) -> list[str]:
    """One line per user reward call and its score on the first record; one ValueError naming the call otherwise."""
    calls = [r for r in spec.rpcs if r.interface_impl in PROBED]
    if not calls or dataset is None or len(dataset) == 0:
        return []
    ids = dataset.prompt_tokens(0)
    prompt = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else list(ids)
    response: Any = "" if tokenizer is not None else []
    record = dict(dataset.record(0))
    lines = []
    for call in calls:
        got, who = _score(call.name, call.interface_impl, dict(call.interface_args), prompt, response, record)
        if got is None:  # a service slower than show waits: said, not refused
            lines.append(f"reward {call.name}: not checked: {who}")
            continue
        value = _one_score(call.name, who, got)
        lines.append(f"reward {call.name}: {who}(first record, empty response) = {value:g}")
    return lines


def _score(call: str, impl: str, args: dict[str, Any], prompt: Any, response: Any,
           record: dict[str, Any]) -> tuple[Any, str]:
    where = "on the dataset's first record with an empty response (`realloc show` tries every reward so)"
    if impl == "batch_reward":
        from realloc.algorithms.rewards.reward_args import check_batch

        check_batch(call, args)
        fn = args.pop("fn")
        name = getattr(fn, "__name__", "the reward function")
        try:
            return fn([prompt], [response], [record], **args), name
        except Exception as e:  # noqa: BLE001 - the user's code: any error is theirs, reported as one line
            raise ValueError(f"call {call!r}: the reward function {name} raised {type(e).__name__}: {e} {where}"
                             f"{user_code.where(e)}") from None
    from realloc.algorithms.rewards.remote_reward import RemoteReward, RewardServiceError, RewardServiceTimeout

    configured = RemoteReward.of(call, args)
    service = dataclasses.replace(configured, timeout=min(configured.timeout, PROBE_TIMEOUT),
                                  retries=min(configured.retries, 1))
    try:
        return service.score([prompt], [response], [record]), f"reward service {service.url}"
    except RewardServiceTimeout as e:
        if configured.timeout <= PROBE_TIMEOUT:
            raise ValueError(f"call {call!r} (`realloc show` sent it the dataset's first record): {e}") from None
        # Slower than show waits, but maybe within the run's own deadline: not an error of the experiment.
        return None, (f"reward service {service.url} gave no answer within {PROBE_TIMEOUT:g} s, the most `realloc "
                      f"show` waits; a run waits up to its timeout={configured.timeout:g} s per request")
    except (RewardServiceError, OSError, ValueError) as e:
        raise ValueError(f"call {call!r} (`realloc show` sent it the dataset's first record): {e}") from None


def _one_score(call: str, who: str, got: Any) -> float:
    try:
        values = [float(x) for x in got]
    except (TypeError, ValueError):
        values = []
    if len(values) != 1 or not math.isfinite(values[0]):
        raise ValueError(f"call {call!r}: {who} returned {got!r} for one sequence (the dataset's first record); "
                         f"return one finite number per sequence")
    return values[0]
