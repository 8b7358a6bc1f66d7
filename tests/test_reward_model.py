"""Reward-model training (Bradley-Terry, ``realloc/algorithms/pairs/rm_train.py``) against hand-computed references.

- The loss formula and the settings' checks, on small tensors.
- The train step and the pair scoring on a tiny HF sequence-classification model, with prompts and responses
  of different lengths read through the real preference dataset (token-id records with a per-pair margin
  field), on 2 gloo processes in three layouts (dp=2, tp=2, pp=2): the scores of both responses, the loss,
  accuracy, margin and mean rewards, and the gradient norm must equal what a dense transformers model gives
  with the formula written out by hand, ``-log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2``, in every layout.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from model_helpers import build_model, tiny_hf_model
from mp_pool import GlooPool
from realloc.algorithms.pairs.reward_model import PAIR_SUMS, STATS, RewardModelConfig, pair_metrics, rm_rpcs
from realloc.api import INFERENCE, TRAIN_STEP, ModelFunctionCallDef

P, T, N, SEED = 8, 6, 8, 3
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (dp, tp, pp)
CFG = RewardModelConfig(lr=1e-3, margin=0.25, margin_field="strength", center_coef=0.01)


def test_bradley_terry_loss_is_the_formula():
    from realloc.algorithms.pairs.rm_train import bradley_terry_loss

    c, r = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64), torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64)
    m = torch.tensor([0.0, 0.3, -1.0], dtype=torch.float64)
    want = [math.log1p(math.exp(-(ci - ri - mi))) + 0.1 * (ci + ri) ** 2
            for ci, ri, mi in zip(c.tolist(), r.tolist(), m.tolist())]
    assert bradley_terry_loss(c, r, m, 0.1).tolist() == pytest.approx(want, rel=1e-12)
    assert bradley_terry_loss(c, r).tolist() == pytest.approx([math.log1p(math.exp(-(a - b)))
                                                               for a, b in zip(c.tolist(), r.tolist())], rel=1e-12)
    # Equal rewards and no margin: log 2, the loss of a model that cannot tell the responses apart.
    assert float(bradley_terry_loss(torch.zeros(1), torch.zeros(1))) == pytest.approx(math.log(2))


def test_pair_metrics_are_means_over_the_pairs():
    sums = {PAIR_SUMS["rm_loss"]: 3.0, PAIR_SUMS["rm_accuracy"]: 3.0, PAIR_SUMS["rm_margin"]: -2.0,
            PAIR_SUMS["rm_chosen"]: 1.0, PAIR_SUMS["rm_rejected"]: 3.0, "n_pairs": 4.0}
    assert pair_metrics(sums) == {"rm_loss": 0.75, "rm_accuracy": 0.75, "rm_margin": -0.5, "rm_chosen": 0.25,
                                  "rm_rejected": 0.75, "n": 4}


@pytest.mark.parametrize("kw, match", [
    ({"margin": "1"}, "RewardModelConfig.margin must be a number"),
    ({"margin_field": ""}, "RewardModelConfig.margin_field"),
    ({"center_coef": -0.1}, "RewardModelConfig.center_coef must be >= 0"),
    ({"lr": 0.0}, "RewardModelConfig.lr must be positive"),
])
def test_settings_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        RewardModelConfig(**kw)


def test_rm_graph_is_one_train_step_of_a_scalar_head_model():
    (call,) = rm_rpcs(model_type="tiny-critic", n_minibatches=2)
    assert (call.name, call.model_name, call.interface_type, call.interface_impl, call.input_data) == \
        ("rm_train", "reward", TRAIN_STEP, "rm", ("pairs",))


# -- the train step and the scoring against transformers ---------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random LlamaForSequenceClassification and a JSONL of token-id pairs of different lengths."""
    d = tmp_path_factory.mktemp("rm")
    hf = tiny_hf_model(d / "model", seed=4, kv_heads=2, critic=True)
    g = torch.Generator().manual_seed(11)
    lines = []
    for i in range(N + 3):  # more records than a batch: the batch's rows are a seeded draw
        p, c, r = (int(torch.randint(lo, hi + 1, (1,), generator=g)) for lo, hi in ((2, P), (1, T), (1, T)))
        ids = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (p, c, r)]
        lines.append(json.dumps({"prompt": ids[0], "chosen": ids[1], "rejected": ids[2], "strength": 0.5 * (i % 3)}))
    (d / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return hf, d / "model", d / "pairs.jsonl"


def _rm_case(pctx, model_dir, pairs_path, dp, tp, pp, cfg, n_mbs):
    from realloc.algorithms.context import CallContext
    from realloc.algorithms.pairs.rm_train import rm_pair_scores, rm_train
    from realloc.data.pairs import PreferenceDataset
    from realloc.models.hf_io import model_config_from_hf
    from realloc.runtime.inputs.datasets import dataset_rows
    from realloc.strategy import even_ranges

    model = build_model(pctx, model_config_from_hf(str(model_dir)), dp, tp, pp, hf_path=str(model_dir))
    ds = PreferenceDataset.load(pairs_path, P, T)
    lo, hi = even_ranges(N, dp)[model.groups.dp_rank]
    pairs = dataset_rows(ds, 0, N, SEED, lo, hi)

    def ctx(itype, optimizer):
        call = ModelFunctionCallDef(name="rm_train", model_name="reward", interface_type=itype, interface_impl="rm",
                                    input_data=["pairs"], n_minibatches=1)
        return CallContext(call=call, model=model, optimizer=optimizer, config=cfg, prompt_len=P, gen_len=T,
                           seed=1, iteration=0, ids=range(lo, hi), batch_size=N, n_mbs=n_mbs, records=ds.record)

    scored = rm_pair_scores(ctx(INFERENCE, None), {"pairs": pairs})
    trained = rm_train(ctx(TRAIN_STEP, model.make_optimizer(cfg.lr, eps=cfg.adam_eps)), {"pairs": pairs})
    reporter = model.groups.is_last_stage and model.groups.tp_rank == 0
    return {"rows": (lo, hi), "reporter": reporter, "scores": scored.outputs.get("pair_rewards"),
            "score_sums": scored.sums, "sums": trained.sums, "globals": trained.globals}


def _reference(hf, pairs_path):
    """Dense transformers: each response scored alone (no padding), the formula by hand, its gradient norm."""
    import copy

    from realloc.data.pairs import PreferenceDataset

    ds = PreferenceDataset.load(pairs_path, P, T)
    batch, rows = ds.batch(0, N, SEED), ds.batch_rows(0, N, SEED)
    ref = copy.deepcopy(hf).train()
    ref.zero_grad()
    chosen, rejected, losses = [], [], []
    for b in range(N):
        p = int(batch["prompt_lens"][b])
        score = []
        for side in ("chosen", "rejected"):
            n = int(batch[f"{side}_mask"][b].sum())
            score.append(ref(input_ids=batch[f"{side}_tokens"][b:b + 1, :p + n]).logits[0, 0].double())
        c, r = score
        m = CFG.margin + ds.record(int(rows[b]))["strength"]
        loss = torch.log1p(torch.exp(-(c - r - m))) + CFG.center_coef * (c + r) ** 2
        (loss / N).backward()
        chosen.append(float(c.detach()))
        rejected.append(float(r.detach()))
        losses.append(float(loss.detach()))
    grad_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters() if p.grad is not None))
    c, r = torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64)
    stats = {"rm_loss": sum(losses) / N, "rm_accuracy": float((c > r).double().mean()),
             "rm_margin": float((c - r).mean()), "rm_chosen": float(c.mean()), "rm_rejected": float(r.mean())}
    return c, r, stats, grad_norm


def test_train_step_and_scores_match_transformers_in_every_layout(pool, assets):
    hf, model_dir, pairs_path = assets
    want_c, want_r, want, want_norm = _reference(hf, pairs_path)
    assert 0 < want["rm_accuracy"] < 1 and want_norm > 1e-3  # a comparison that can fail
    for dp, tp, pp in LAYOUTS:
        res = pool.run(_rm_case, str(model_dir), str(pairs_path), dp, tp, pp, CFG, 2)
        reporters = [r for r in res if r["reporter"]]
        assert len(reporters) == dp
        where = f"dp{dp} tp{tp} pp{pp}"
        got_c = torch.cat([r["scores"]["chosen"] for r in sorted(reporters, key=lambda r: r["rows"])]).double()
        got_r = torch.cat([r["scores"]["rejected"] for r in sorted(reporters, key=lambda r: r["rows"])]).double()
        torch.testing.assert_close(got_c, want_c, atol=1e-4, rtol=0, msg=where)
        torch.testing.assert_close(got_r, want_r, atol=1e-4, rtol=0, msg=where)
        # The master adds the reporters' sums; the train step's are means over the batch's pairs already.
        sums = {k: sum(r["sums"][k] for r in reporters) for k in STATS}
        scored = pair_metrics({k: sum(r["score_sums"][k] for r in reporters) for k in reporters[0]["score_sums"]})
        assert scored.pop("n") == N
        for k in STATS:
            assert sums[k] == pytest.approx(want[k], abs=1e-4), (where, k)
            assert scored[k] == pytest.approx(want[k], abs=1e-4), (where, "scores", k)
        norm = next(r["globals"]["rm_grad_norm"] for r in res if r["reporter"])
        assert norm == pytest.approx(want_norm, rel=1e-4), where


# -- the planner's view and the evaluation's calls ----------------------------------------------------------------
def test_estimator_prices_both_responses_of_every_pair_and_the_search_places_the_step(capsys):
    import dataclasses
    import types

    from hf_assets import REPO
    from realloc.algorithms.registry import builtin_interfaces
    from realloc.api import load_experiment
    from realloc.cli import main
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.strategy import ParallelStrategy

    experiment = str(REPO / "experiments/rm_7b.py")
    spec = load_experiment(experiment)
    rm = CostModel(build_graph(spec), discover=False)
    # 512 pairs, 4 mini-batches: 128 pairs a step, 256 sequences through the model.
    assert rm.workload("rm_train").n_seqs == 256
    # The same cost as a train step of the same model on 1,024 single sequences.
    flat_iface = dataclasses.replace(builtin_interfaces()[("rm", TRAIN_STEP)], name="flat_rm", rows_per_seq=1)
    flat_spec = dataclasses.replace(spec, batch_size=2 * spec.batch_size,
                                    rpcs=tuple(dataclasses.replace(r, interface_impl="flat_rm") for r in spec.rpcs),
                                    config=types.SimpleNamespace(rm=spec.config.rm, interfaces=[flat_iface]))
    flat = CostModel(build_graph(flat_spec), discover=False)
    mesh = spec.cluster.whole
    for strategy, n_mbs in ((ParallelStrategy(8, 1, 1), 4), (ParallelStrategy(2, 2, 2), 8)):
        assert rm.call_cost("rm_train", mesh, strategy, n_mbs) == flat.call_cost("rm_train", mesh, strategy, n_mbs)
    assert main(["search", experiment, "--dry-run", "--evals", "1500", "--threads", "1"]) == 0
    table = capsys.readouterr().out.split("searched plan", 1)[1]
    assert "\nrm_train " in table and "fits in" in table


def test_evaluation_of_a_graph_without_generation_scores_pairs_in_the_train_layout():
    from hf_assets import REPO
    from realloc.api import load_experiment
    from realloc.runtime.inputs.evaluation import eval_calls

    ec = eval_calls(load_experiment(str(REPO / "experiments/arith_rm.py")))
    assert (ec.generate, ec.train, ec.reward, ec.scorer) == ("rm_train", "rm_train", "rm_train", "rm")
    # DPO's train step has no scoring namesake: an eval set there is refused, naming what is missing.
    with pytest.raises(ValueError, match="evaluation needs a GENERATE call that reads the prompts"):
        eval_calls(load_experiment(str(REPO / "experiments/dpo_tiny.py")))


def test_a_wrong_eval_set_or_margin_field_is_one_clear_error(capsys):
    from hf_assets import REPO
    from realloc.algorithms.context import CallContext
    from realloc.algorithms.pairs.rm_train import pair_margins
    from realloc.cli import main

    # Held-out prompts (no responses) where the evaluation scores pairs: refused before any worker starts.
    assert main(["show", str(REPO / "experiments/arith_rm.py"), "--set", "eval.dataset=data/arith_eval.jsonl"]) != 0
    assert "arith_eval.jsonl:1: 'chosen' is missing" in capsys.readouterr().err
    call = rm_rpcs()[0]
    pairs = {"prompt_lens": torch.tensor([2, 3]), "rows": torch.tensor([0, 1])}
    records = {0: {"strength": 1.5}, 1: {"strength": "high"}}
    ctx = CallContext(call=call, model=None, optimizer=None, config=CFG, prompt_len=P, gen_len=T, seed=0, iteration=0,
                      ids=range(2), batch_size=2, n_mbs=1, records=records.__getitem__)
    with pytest.raises(ValueError, match=r"call 'rm_train': rm.margin_field='strength': dataset row 1 has 'high'"):
        pair_margins(ctx, pairs)
    records[1] = {"strength": 2}
    assert pair_margins(ctx, pairs).tolist() == [CFG.margin + 1.5, CFG.margin + 2.0]
