"""`realloc run` from HF checkpoints on text prompts, end to end on 4 local CPU devices, then `realloc export`.

The actor, reference and critic start from one tiny sharded LLaMA checkpoint (the critic with a
fresh value head), the reward is a LLaMA sequence-classification checkpoint, the tokenizer is the
one trained on the shipped corpus, and the prompts are the shipped text prompts (mixed lengths,
long ones truncated). Generation is greedy (top_k=1) and stops at any of a set of EOS ids, so rows
end at different steps. Checked:
- the same metrics under three plans (one device; tp=2/pp=2 training with reallocation; actor and
  critic on disjoint meshes) for 3 iterations;
- iteration 0's logged samples: the tokens HF's greedy `generate` produces from the same prompt,
  and the reward HF's sequence classifier gives the sequence;
- the first PPO step starts at ratio 1 (old and new log-probs are aligned per row);
- the model exported after the tp=2/pp=2 run loads in transformers, and its logits equal
  realloc's on the same weights within 1e-4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mp_pool import GlooPool
from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan

REPO = Path(__file__).resolve().parents[1]
ITERS = 3
GEN_LEN = 8
EXTRA_EOS = list(range(100, 164))  # a stop set wide enough that greedy rows stop at different steps
HEADLINE = ("reward", "kl", "actor_loss", "critic_loss", "approx_kl", "actor_grad_norm", "critic_grad_norm",
            "value_mean", "return_mean", "response_len", "eos_frac")

EXPERIMENT = '''
import dataclasses
from realloc.algorithms.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import HFModel, auto
from realloc.data.config import DataConfig

@auto(nodelist="localhost", n_devices_per_node=4, device="cpu", batch_size=8, prompt_len=24, gen_len={GEN_LEN})
@dataclasses.dataclass
class HFPPO:
    seed: int = 3
    dataset: str = "{DATASET}"
    data: DataConfig = DataConfig(overflow="truncate", truncation_side="left")
    sample_every: int = 1
    n_samples: int = 4
    ppo: PPOConfig = PPOConfig(n_minibatches=1, lr=2e-3, critic_lr=2e-3, kl_coef=0.05, top_k=1)

    @property
    def models(self):
        return {{"actor": "actor", "ref": "actor", "critic": HFModel("actor", new_value_head=True),
                "reward": "reward"}}

    @property
    def rpcs(self):
        return ppo_rpcs(n_minibatches=1)
'''

PLANS = {
    "one_device": {c: ("localhost:0", 1, 1, 1, 1) for c in
                   ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")},
    "tp2pp2": {"actor_gen": ("localhost", 2, 2, 1, 1), "rew_inf": ("localhost:0-1", 1, 2, 1, 2),
               "ref_inf": ("localhost:2-3", 1, 1, 2, 2), "critic_inf": ("localhost", 4, 1, 1, 1),
               "actor_train": ("localhost", 1, 2, 2, 2), "critic_train": ("localhost:2-3", 1, 1, 2, 2)},
    "split": {"actor_gen": ("localhost:0-1", 2, 1, 1, 1), "ref_inf": ("localhost:0-1", 1, 2, 1, 1),
              "actor_train": ("localhost:0-1", 2, 1, 1, 2), "rew_inf": ("localhost:2-3", 2, 1, 1, 1),
              "critic_inf": ("localhost:2-3", 2, 1, 1, 1), "critic_train": ("localhost:2-3", 1, 2, 1, 1)},
}


@pytest.fixture(scope="module")
def experiment(hf_assets, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_e2e")
    shutil.copytree(hf_assets.checkpoint("llama"), root / "actor")
    shutil.copytree(hf_assets.checkpoint("llama_reward"), root / "reward")
    gen = json.loads((root / "actor/generation_config.json").read_text())
    first = gen["eos_token_id"] if isinstance(gen["eos_token_id"], int) else gen["eos_token_id"][0]
    gen["eos_token_id"] = [first] + EXTRA_EOS
    (root / "actor/generation_config.json").write_text(json.dumps(gen))
    f = root / "exp.py"
    f.write_text(EXPERIMENT.format(GEN_LEN=GEN_LEN, DATASET=REPO / "experiments/data/text_prompts.jsonl"))
    return f


def _plan(experiment: Path, name: str) -> Path:
    spec = load_experiment(str(experiment))
    g = build_graph(spec)
    plan = ExecutionPlan.by_hand(g, PLANS[name], source=name)
    path = experiment.parent / f"plan-{name}.json"
    plan.save(path)
    return path


class Runs:
    def __init__(self, experiment: Path) -> None:
        self.experiment = experiment
        self.dirs: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.dirs:
            run_dir = self.experiment.parent / f"run-{name}"
            cmd = [sys.executable, "-m", "realloc.cli", "run", str(self.experiment), "--plan",
                   str(_plan(self.experiment, name)), "--iterations", str(ITERS), "--run-dir", str(run_dir),
                   "--quiet", "--export-every", str(ITERS)]
            env = {**os.environ, "TMPDIR": str(self.experiment.parent), "PYTHONPATH": str(REPO)}
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            assert r.returncode == 0, f"plan {name} failed:\n{r.stdout}\n{r.stderr}"
            self.dirs[name] = run_dir
        return self.dirs[name]


@pytest.fixture(scope="module")
def runs(experiment) -> Runs:
    return Runs(experiment)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("plan", ["tp2pp2", "split"])
def test_same_metrics_under_every_plan(runs, plan):
    ref, got = _metrics(runs["one_device"]), _metrics(runs[plan])
    assert len(ref) == len(got) == ITERS
    for a, b in zip(ref, got):
        for k in HEADLINE:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (plan, a["iteration"], k)
    assert ref[-1]["kl"] > 1e-3  # training moved the policy: not a degenerate comparison


def test_variable_lengths_and_first_step_alignment(runs):
    m = _metrics(runs["one_device"])
    assert 0 < m[0]["eos_frac"] < 1 and m[0]["response_len"] < GEN_LEN
    # One PPO mini-batch: the first update sees ratio exp(new - old) = 1 on every valid token, which
    # holds only if generation, inference and the loss read the same response positions of each row.
    assert abs(m[0]["approx_kl"]) < 1e-5 and m[0]["actor_clip_frac"] == 0.0


def test_samples_match_transformers(runs, experiment):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = experiment.parent
    actor = AutoModelForCausalLM.from_pretrained(root / "actor").eval()
    reward = AutoModelForSequenceClassification.from_pretrained(root / "reward").eval()
    eos = json.loads((root / "actor/generation_config.json").read_text())["eos_token_id"]
    samples = [json.loads(line) for line in (runs["one_device"] / "samples.jsonl").read_text().splitlines()]
    first = [s for s in samples if s["iteration"] == 1]
    assert [s["seq"] for s in first] == [0, 1, 2, 3]
    assert {s["iteration"] for s in samples} == set(range(1, ITERS + 1))
    lengths = set()
    for s in first:
        assert s["prompt"] and isinstance(s["response"], str)
        prompt = torch.tensor([s["prompt_ids"]])
        assert prompt.shape[1] <= 24
        with torch.no_grad():
            want = actor.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=GEN_LEN,
                                  do_sample=False, eos_token_id=eos, pad_token_id=0)[0, prompt.shape[1]:].tolist()
            score = reward(input_ids=torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0, 0]
        want = want[:next((i + 1 for i, t in enumerate(want) if t in eos), len(want))]
        assert s["response_ids"] == want
        assert s["reward"] == pytest.approx(float(score), abs=1e-4)
        lengths.add((len(s["prompt_ids"]), len(s["response_ids"])))
    assert len(lengths) > 1


def _logits_from_export(ctx, path: str, ids: torch.Tensor):
    from model_helpers import build_model
    from realloc.models.hf_io import model_config_from_hf

    model = build_model(ctx, model_config_from_hf(path), 1, 2, 1, hf_path=path)
    return model.forward({"input_ids": ids, "lengths": torch.tensor([ids.shape[1]] * ids.shape[0])},
                         output="logits")


def test_export_after_tp2_pp2_training_loads_in_transformers(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run = runs["tp2pp2"]
    exported = run / "exports" / f"iter_{ITERS:08d}"
    actor = AutoModelForCausalLM.from_pretrained(exported / "actor").eval()
    critic = AutoModelForSequenceClassification.from_pretrained(exported / "critic").eval()
    assert critic.config.num_labels == 1
    assert (exported / "actor" / "tokenizer.json").is_file()
    # Trained: the actor moved away from its checkpoint.
    start = AutoModelForCausalLM.from_pretrained(runs.experiment.parent / "actor")
    moved = max((a - b).abs().max().item() for a, b in zip(actor.state_dict().values(), start.state_dict().values()))
    assert moved > 1e-4
    # The CLI writes the same files from the run directory.
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "export", str(run), "--model", "actor", "--out", str(out)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    a = {k: v for f in sorted((exported / "actor").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[5, 17, 42, 7, 99, 3], [8, 8, 120, 64, 31, 2]])
    with GlooPool(2, tmp_path / "gloo") as pool:
        ours = pool.run(_logits_from_export, str(exported / "actor"), ids)[0]
    with torch.no_grad():
        theirs = actor(input_ids=ids).logits.float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
