"""`realloc run` from HF checkpoints on text prompts, end to end on 4 local CPU devices, then `realloc export`.

The actor and reference start from one tiny sharded Qwen2 checkpoint (q/k/v biases), the critic from a
LLaMA sequence-classification checkpoint, the reward is a Qwen2 sequence-classification checkpoint, the
tokenizer is the one trained on the shipped corpus, and the prompts are the shipped text prompts (mixed
lengths, long ones truncated). Generation stops at any of a set of EOS ids, so rows end at different steps;
it is greedy (top_k=1) in two runs and sampled (temperature 1, no top-k) in two others. The checkpoints'
vocabulary (512) is padded past the tokenizer's 500 tokens, and generation never emits the padding ids.
Every run exports every 2 iterations (after 2, and after the last, 3).
Checked:
- the same metrics under every plan of a decoding mode for 3 iterations: greedy on one device and with
  tp=2/pp=2 training with reallocation; sampled with actor and critic on disjoint meshes (the frozen reference
  and reward offloaded) and with the tp=2/pp=2 plan;
- iteration 1's logged samples: the tokens HF's greedy `generate` (the padding ids suppressed) produces from
  the same prompt, the generation's per-token log-probs within 1e-4 of HF's (also when sampled), and the reward
  HF's sequence classifier gives;
- data.json in the run directory counts the prompts longer than prompt_len as transformers' tokenizer does;
- the first PPO step starts at ratio 1 (old and new log-probs are aligned per row);
- the export after iteration 2 holds the weights that generated iteration 3: HF's greedy tokens and
  log-probs from it equal the run's iteration-3 samples;
- the models exported after the tp=2/pp=2 run load in transformers, and their logits (actor) and values
  (critic) equal realloc's from the run's own checkpoint shards in their tp=2/pp=2 and pp=2 layouts,
  within 1e-4.
"""

from __future__ import annotations

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
from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import auto
from realloc.data.config import DataConfig

@auto(nodelist="localhost", n_devices_per_node=4, device="cpu", batch_size=8, prompt_len=24, gen_len={GEN_LEN})
@dataclasses.dataclass
class HFPPO:
    seed: int = 3
    dataset: str = "{DATASET}"
    data: DataConfig = DataConfig(overflow="truncate", truncation_side="left")
    sample_every: int = 1
    log_samples: int = 4
    ppo: PPOConfig = PPOConfig(n_minibatches=1, lr=2e-3, critic_lr=2e-3, kl_coef=0.05, top_k=1)

    @property
    def models(self):
        return {{"actor": "actor", "ref": "actor", "critic": "critic", "reward": "reward"}}

    @property
    def rpcs(self):
        return ppo_rpcs(n_minibatches=1)
'''

EXPORT_EVERY = 2
# run name -> (plan, sampled): a sampled run draws from the full distribution (temperature 1, no top-k)
RUNS = {"one_device": ("one_device", False), "tp2pp2": ("tp2pp2", False), "split": ("split", True),
        "tp2pp2_sampled": ("tp2pp2", True)}
SAMPLED = ("--set", "ppo.top_k=0")
# The frozen models wait in host memory between their calls in the split plan.
OFFLOAD = {"split": {"ref": True, "reward": True}}
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
    shutil.copytree(hf_assets.checkpoint("qwen2", max_shard_size="200KB"), root / "actor")  # sharded
    shutil.copytree(hf_assets.checkpoint("llama_reward"), root / "critic")  # a critic from a scalar-head checkpoint
    shutil.copytree(hf_assets.checkpoint("qwen2_reward"), root / "reward")
    return write_experiment(root)


def write_experiment(root: Path) -> Path:
    """The experiment file beside the checkpoints ``root``/{actor, critic, reward}, the actor stopping at any of
    ``EXTRA_EOS`` too."""
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
    plan = ExecutionPlan.by_hand(g, PLANS[name], offload=OFFLOAD.get(name, {}), source=name)
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
            plan, sampled = RUNS[name]
            cmd = [sys.executable, "-m", "realloc.cli", "run", str(self.experiment), "--plan",
                   str(_plan(self.experiment, plan)), "--iterations", str(ITERS), "--run-dir", str(run_dir),
                   "--quiet", "--export-every", str(EXPORT_EVERY), *(SAMPLED if sampled else ())]
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


@pytest.mark.parametrize("first, second", [("one_device", "tp2pp2"), ("split", "tp2pp2_sampled")])
def test_same_metrics_under_every_plan(runs, first, second):
    ref, got = _metrics(runs[first]), _metrics(runs[second])
    assert len(ref) == len(got) == ITERS
    for a, b in zip(ref, got):
        for k in HEADLINE:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (first, second, a["iteration"], k)
    assert ref[-1]["kl"] > 1e-3  # training moved the policy: not a degenerate comparison
    for name in (first, second):
        if RUNS[name][0] in OFFLOAD:
            assert all(m["time"].get("offload", 0) > 0 and m["time"].get("reload", 0) > 0
                       for m in _metrics(runs[name])[1:])


def test_sampled_runs_draw_other_responses_inside_the_tokenizer(runs):
    """Sampling is not greedy decoding under another name, and no run emits an id past the tokenizer's 500
    tokens (the checkpoints' 512-row vocabulary would allow them)."""
    greedy, sampled = _samples(runs["one_device"], 1), _samples(runs["split"], 1)
    assert [s["prompt_ids"] for s in greedy] == [s["prompt_ids"] for s in sampled]
    assert [s["response_ids"] for s in greedy] != [s["response_ids"] for s in sampled]
    for name in RUNS:
        ids = [t for it in range(1, ITERS + 1) for s in _samples(runs[name], it) for t in s["response_ids"]]
        assert ids and max(ids) < 500, name


def test_variable_lengths_and_first_step_alignment(runs):
    from transformers import AutoTokenizer

    m = _metrics(runs["one_device"])
    # The truncation counts of the console line are in the run directory, as transformers' tokenizer counts.
    tok = AutoTokenizer.from_pretrained(runs.experiment.parent / "actor")  # the run's tokenizer: the actor's
    prompts = [json.loads(line)["prompt"] for line in (REPO / "experiments/data/text_prompts.jsonl").open()]
    long = sum(len(ids) > 24 for ids in tok(prompts)["input_ids"])
    data = json.loads((runs["one_device"] / "data.json").read_text())
    assert 0 < long < len(prompts)
    n = len(prompts)
    assert (data["n_records"], data["n_kept"], data["n_truncated"], data["n_dropped"]) == (n, n, long, 0)
    assert data["n_too_long"] == long and data["prompt_len"] == 24 and data["max_tokens"] == 24
    assert 0 < m[0]["eos_frac"] < 1 and m[0]["response_len"] < GEN_LEN
    # One PPO mini-batch: the first update sees ratio exp(new - old) = 1 on every valid token, which
    # holds only if generation, inference and the loss read the same response positions of each row.
    assert abs(m[0]["approx_kl"]) < 1e-5 and m[0]["actor_clip_frac"] == 0.0


def _samples(run: Path, iteration: int) -> list[dict]:
    lines = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["iteration"] for s in lines} == set(range(1, ITERS + 1))
    return [s for s in lines if s["iteration"] == iteration]


def _check_against_transformers(samples: list[dict], actor, eos: list[int], greedy: bool = True) -> torch.Tensor:
    """Each sample's response is HF's greedy output from its prompt (``greedy``; HF suppressing the ids past the
    tokenizer, as realloc does) and its per-token log-probs are HF's within 1e-4; returns HF's log-probs of all
    responses, concatenated."""
    hf_logps = []
    padding = list(range(500, actor.config.vocab_size))  # the tokenizer has 500 tokens
    for s in samples:
        prompt = torch.tensor([s["prompt_ids"]])
        with torch.no_grad():
            if greedy:
                want = actor.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=GEN_LEN,
                                      do_sample=False, eos_token_id=eos, pad_token_id=0,
                                      suppress_tokens=padding)[0, prompt.shape[1]:].tolist()
                want = want[:next((i + 1 for i, t in enumerate(want) if t in eos), len(want))]
                assert s["response_ids"] == want, (s["iteration"], s["seq"])
            logits = actor(input_ids=torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0].float()
        want = s["response_ids"]
        plen, n = len(s["prompt_ids"]), len(s["response_ids"])
        hf = torch.log_softmax(logits[plen - 1:plen - 1 + n], -1).gather(-1, torch.tensor(want)[:, None])[:, 0]
        assert len(s["logp"]) == n
        torch.testing.assert_close(torch.tensor(s["logp"]), hf, atol=1e-4, rtol=0)
        hf_logps.append(hf)
    return torch.cat(hf_logps)


def test_samples_match_transformers(runs, experiment):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = experiment.parent
    actor = AutoModelForCausalLM.from_pretrained(root / "actor").eval()
    reward = AutoModelForSequenceClassification.from_pretrained(root / "reward").eval()
    eos = json.loads((root / "actor/generation_config.json").read_text())["eos_token_id"]
    first = _samples(runs["one_device"], 1)
    assert [s["seq"] for s in first] == [0, 1, 2, 3]
    _check_against_transformers(first, actor, eos)
    _check_against_transformers(_samples(runs["split"], 1), actor, eos, greedy=False)
    lengths = set()
    for s in first:
        assert s["prompt"] and isinstance(s["response"], str) and len(s["prompt_ids"]) <= 24
        with torch.no_grad():
            score = reward(input_ids=torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0, 0]
        assert s["reward"] == pytest.approx(float(score), abs=1e-4)
        lengths.add((len(s["prompt_ids"]), len(s["response_ids"])))
    assert len(lengths) > 1


def test_intermediate_export_holds_the_weights_that_generated_the_next_iteration(runs, experiment):
    """--export-every 2 in a 3-iteration run: exports after iterations 2 and 3. Iteration 3 generates with
    the weights after iteration 2, so HF's greedy tokens and log-probs from that export are its samples'."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run = runs["tp2pp2"]
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["iter_00000002", "iter_00000003"]
    for done in (2, 3):
        assert json.loads((run / "checkpoints" / f"iter_{done:08d}" / "meta.json").read_text())["iteration"] == done
        assert AutoModelForSequenceClassification.from_pretrained(run / f"exports/iter_{done:08d}/critic").config.num_labels == 1
    actor = AutoModelForCausalLM.from_pretrained(run / "exports/iter_00000002/actor").eval()
    eos = json.loads((experiment.parent / "actor/generation_config.json").read_text())["eos_token_id"]
    third = _samples(run, 3)
    after_two = _check_against_transformers(third, actor, eos)
    # Not a degenerate comparison: the starting weights give these responses other log-probs.
    start = AutoModelForCausalLM.from_pretrained(experiment.parent / "actor").eval()
    with torch.no_grad():
        before = torch.cat([torch.log_softmax(start(input_ids=torch.tensor([s["prompt_ids"] + s["response_ids"]]))
                                              .logits[0, len(s["prompt_ids"]) - 1:-1].float(), -1)
                            .gather(-1, torch.tensor(s["response_ids"])[:, None])[:, 0] for s in third])
    assert (before - after_two).abs().max() > 1e-3


def _outputs_from_checkpoint(ctx, ckpt: str, model: str, cfg, ids: torch.Tensor, output: str):
    """On every pool rank: build ``model`` in the layout its checkpoint was saved in, load its shards and run
    a forward pass; the last pipeline stage returns ``output``."""
    from model_helpers import build_model
    from realloc.runtime.persist import checkpoint

    meta = checkpoint.read_meta(Path(ckpt))
    rec = meta["models"][model]
    m = build_model(ctx, cfg, 1, rec["tp"], rec["pp"])
    if m is None:
        return None
    checkpoint.load_model_shard(Path(ckpt), model, m.groups.tp_rank, m.groups.pp_rank, meta["layouts"][model],
                                m.params(), None)
    return m.forward({"input_ids": ids, "lengths": torch.tensor([ids.shape[1]] * ids.shape[0])}, output=output)


def test_export_after_tp2_pp2_training_matches_the_checkpoint_shards(runs, experiment, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run = runs["tp2pp2"]
    exported = run / "exports" / f"iter_{ITERS:08d}"
    ckpt = run / "checkpoints" / f"iter_{ITERS:08d}"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["models"]["actor"]["tp"], meta["models"]["actor"]["pp"]) == (2, 2)
    assert (meta["models"]["critic"]["tp"], meta["models"]["critic"]["pp"]) == (1, 2)
    actor = AutoModelForCausalLM.from_pretrained(exported / "actor").eval()
    critic = AutoModelForSequenceClassification.from_pretrained(exported / "critic").eval()
    assert critic.config.num_labels == 1
    assert (exported / "actor" / "tokenizer.json").is_file()
    # Trained: the actor moved away from its checkpoint.
    start = AutoModelForCausalLM.from_pretrained(experiment.parent / "actor")
    moved = max((a - b).abs().max().item() for a, b in zip(actor.state_dict().values(), start.state_dict().values()))
    assert moved > 1e-4
    # The CLI writes the same files from the run directory.
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "export", str(run), "--model", "actor", "--out", str(out)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    a = {k: v for f in sorted((exported / "actor").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # realloc's outputs from the run's own shards, in the layouts they were saved in, against transformers'
    # from the merged export.
    check_export_against_shards(ckpt, experiment.parent, actor, critic, tmp_path)


def check_export_against_shards(ckpt: Path, root: Path, actor, critic, tmp_path: Path) -> None:
    """The exported ``actor``'s logits and ``critic``'s values (transformers) within 1e-4 of realloc's from the
    run checkpoint ``ckpt``'s shards, loaded in their saved layouts (configs from the checkpoints under ``root``)."""
    from realloc.models.hf_io import model_config_from_hf

    ids = torch.tensor([[5, 17, 42, 7, 99, 3], [8, 8, 120, 64, 31, 2]])
    with GlooPool(4, tmp_path / "gloo") as pool:
        logits = next(x for x in pool.run(_outputs_from_checkpoint, str(ckpt), "actor",
                                          model_config_from_hf(root / "actor"), ids, "logits") if x is not None)
        values = next(x for x in pool.run(_outputs_from_checkpoint, str(ckpt), "critic",
                                          model_config_from_hf(root / "critic"), ids, "values") if x is not None)
    with torch.no_grad():
        theirs_logits = actor(input_ids=ids).logits.float()
        theirs_values = critic.score(critic.model(input_ids=ids).last_hidden_state).float()[..., 0]
    torch.testing.assert_close(logits, theirs_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(values, theirs_values, atol=1e-4, rtol=0)
