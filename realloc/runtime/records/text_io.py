"""Token ids the runtime needs from the tokenizer or checkpoint, and the decoded-sample log.

``SpecialTokens``: where generation stops (EOS ids) and what pads a row. Generation stops at the
experiment's tokenizer's EOS ids and those the generating model's checkpoint names
(``generation_config.json``, else ``config.json``); padding and BOS are the tokenizer's, else the
checkpoint's. A random-init model with a token-id dataset has no EOS and pads with 0.
Master and workers compute it the same way from the same files.

``SampleLog``: in iteration 1 and every ``sample_every`` iterations after it (1, 11, 21, ... for 10),
the first ``log_samples`` sequences go to ``samples.jsonl`` in the run directory, one line each. The call
that scores them (output role ``rewards``) gives the text (decoded when there is a tokenizer), ids and
reward, the generation gives each response token's log-prob under the sampling policy; the workers send
these parts with their replies and the master writes one merged line per sequence when the iteration
ends. Iterations count from 1 as in metrics.jsonl::

    {"iteration": 1, "seq": 0, "prompt": "...", "response": "...", "reward": 0.42,
     "prompt_ids": [...], "response_ids": [...], "logp": [-0.3, ...]}

A line of another sequence key than ``seq`` (ReMax's greedy baseline) carries ``"key": "greedy_seq"``.
With partial rollouts a response of a group still pending (cut at ``partial_rollout_tokens``, or finished and waiting
for its group) carries ``"pending": true``; it is logged again, whole, in the iteration that trains it.
A multi-turn rollout (its generation writes a ``loss_mask`` and the rewards; no later call scores it) gets its text,
ids and reward from the generation, and ``turn_segments``: the lengths of the response's alternating runs of environment and policy
tokens, the environment's first (docs/multi-turn.md; the planner reads them, envs/turn_profile.py).

``logp`` is each response token's log-prob as the generation sampled it: ``log_softmax(logits / T)`` at the
generating call's sampling temperature ``T`` (the algorithm settings' ``temperature``), before top-k/top-p
filtering; 1.0 for greedy responses (ReMax's baseline). It is what the PPO-family losses use as the old
policy's log-prob (they score at the same temperature); at T != 1 it is not the model's log-prob at T = 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from realloc.api import ExperimentSpec, InterfaceType
from realloc.envs.turn_profile import SEGMENTS, segments_of
from realloc.runtime.records.run_paths import naming
from realloc.runtime.records.telemetry import iteration_number
from realloc.runtime.wire.protocol import SamplePart

if TYPE_CHECKING:  # torch only types the workers' tensors here: `realloc run`'s master starts without it
    import torch

    from realloc.data.tokenizer import Tokenizer

SAMPLES_FILE = "samples.jsonl"
SAMPLE_BYTES = 1 << 20  # per call and worker: the sample log must not push a reply towards the message limit
_FIELD_ORDER = ("prompt", "response", "reward", "prompt_ids", "response_ids", "logp", SEGMENTS)

log = logging.getLogger("realloc.samples")


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    bos_token_id: int | None = None

    @classmethod
    def of(cls, spec: ExperimentSpec, tokenizer: "Tokenizer | None") -> "SpecialTokens":
        """The tokenizer's ids; EOS also every id the generating checkpoints' generation_config.json (else
        config.json) names: a separate tokenizer directory may lack the ones a chat model ends a turn with
        (LLaMA-3 instruct stops at any of 128001, 128008, 128009)."""
        ckpts = [cls.from_checkpoint(p) for p in generating_checkpoints(spec)]
        ckpt_eos = tuple(t for c in ckpts for t in c.eos_token_ids)
        if tokenizer is not None:
            eos = tuple(dict.fromkeys(tuple(tokenizer.eos_token_ids) + ckpt_eos))  # stable order, no duplicates
            return cls(eos, tokenizer.pad_token_id, tokenizer.bos_token_id)
        if ckpts:
            return dataclasses.replace(ckpts[0], eos_token_ids=tuple(dict.fromkeys(ckpt_eos)))
        return cls()

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "SpecialTokens":
        """Ids from ``generation_config.json`` where present, else ``config.json``."""
        from realloc.models.hf_config import model_config_from_hf

        ids = dict(model_config_from_hf(path).special_tokens)
        eos = ids.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, tuple) else (eos,) if eos is not None else ()
        pad = ids.get("pad_token_id")
        return cls(eos_ids, int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0), ids.get("bos_token_id"))

    def hf_ids(self) -> dict[str, Any]:
        """The ids as config.json / generation_config.json write them (eos: an int or a list)."""
        eos: Any = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (
            self.eos_token_ids[0] if self.eos_token_ids else None)
        return {"bos_token_id": self.bos_token_id, "eos_token_id": eos, "pad_token_id": self.pad_token_id}


def generating_checkpoints(spec: ExperimentSpec) -> list[str]:
    """Checkpoint directories of the models that generate, in call order, each once."""
    paths = [spec.models[r.model_name].path for r in spec.rpcs
             if r.interface_type is InterfaceType.GENERATE and r.model_name in spec.models]
    return list(dict.fromkeys(paths))


class SampleLog:
    """A worker's part of the sample log: the fields of the sequences it holds, for the master to merge."""

    def __init__(self, tokenizer: "Tokenizer | None", every: int, count: int) -> None:
        self.tokenizer = tokenizer
        self.every = every
        self.count = count

    def wanted(self, iteration: int, ids: Sequence[int]) -> list[int]:
        """Local rows to log (``iteration`` counts from 0 here): the batch's first ``count`` sequences that
        this dp rank holds."""
        if self.every <= 0 or self.count <= 0 or iteration % self.every:
            return []
        return [r for r, i in enumerate(ids) if i < self.count]

    def parts(self, iteration: int, ids: Sequence[int], key: str, seq: Mapping[str, torch.Tensor],
              scores: torch.Tensor | None = None, logp: torch.Tensor | None = None,
              rewards: Mapping[str, torch.Tensor] | None = None) -> list[SamplePart]:
        """The reward call's fields (text, ids, reward: ``scores``) or the generation's (per-token ``logp``)
        of the rows to log; at most ``SAMPLE_BYTES`` of them, so a reply stays far below the message limit. A
        multi-turn generation (``loss_mask`` in ``seq``) scores its rollouts itself: ``rewards`` (its ``score``)."""
        # a partial-rollouts generation also writes a loss_mask, but scores nothing itself: no turns to record
        multiturn = "loss_mask" in seq and scores is None and rewards is not None
        if multiturn:
            scores = rewards["score"]
        out, budget = [], SAMPLE_BYTES
        for r in self.wanted(iteration, ids):
            plen, n = int(seq["prompt_lens"][r]), int(seq["gen_mask"][r].sum())
            fields: dict[str, Any] = {}
            if multiturn:
                fields[SEGMENTS] = segments_of(seq["loss_mask"][r, :n].tolist())
            if "loss_mask" in seq and n and not bool(seq["loss_mask"][r, :n].any()):
                # partial rollouts: a response of a pending group (cut, or waiting for its group), logged again in
                # the iteration that trains it; `--lengths-from` skips it (a multi-turn rollout has policy tokens)
                fields["pending"] = True
            if scores is not None or multiturn:
                prompt = seq["tokens"][r, :plen].tolist()
                response = seq["tokens"][r, plen:plen + n].tolist()
                if self.tokenizer is not None:
                    fields["prompt"] = self.tokenizer.decode(prompt, skip_special_tokens=False)
                    fields["response"] = self.tokenizer.decode(response, skip_special_tokens=False)
                fields.update({"prompt_ids": prompt, "response_ids": response})
                if scores is not None:
                    fields["reward"] = float(scores[r])
            if logp is not None:
                fields["logp"] = logp[r, :n].tolist()  # python floats, as float(x) of each: without a call per element
            budget -= len(json.dumps(fields))
            if budget < 0:
                log.warning("%s: logging %d of the %d samples of iteration %d (the rest exceed the %d KiB one reply "
                            "carries; lower log_samples to log whole iterations)", key, len(out),
                            len(self.wanted(iteration, ids)), iteration_number(iteration), SAMPLE_BYTES >> 10)
                break
            out.append(SamplePart(key=key, seq=ids[r], fields=fields))
        return out


def write_samples(run_dir: str | Path, iteration: int, parts: Mapping[tuple[str, int], Mapping[str, Any]]) -> None:
    """Append iteration ``iteration``'s merged samples (``(key, seq) -> fields``) to ``samples.jsonl``."""
    if not parts:
        return
    lines = []
    for (key, seq), fields in sorted(parts.items(), key=lambda kv: (kv[0][0] != "seq", kv[0])):
        rec: dict[str, Any] = {"iteration": iteration_number(iteration), "seq": seq}
        if key != "seq":
            rec["key"] = key
        rec.update({f: fields[f] for f in _FIELD_ORDER if f in fields})
        rec.update({f: v for f, v in fields.items() if f not in rec})
        lines.append(json.dumps(rec) + "\n")
    path = Path(run_dir) / SAMPLES_FILE
    with naming(path), path.open("a") as f:
        f.write("".join(lines))
