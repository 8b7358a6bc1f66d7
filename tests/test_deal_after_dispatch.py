"""Issue 31: with ``balance_tokens`` the master deals the train calls' row lists (and plans their inputs' transfers)
after it dispatched the inference calls the generation made ready, not between the generation's end and their
dispatch (runtime/control/master_balance.py). The lists are the same ``deal_rows`` makes; that the run's results
and checkpoint equal the unbalanced run's is ``test_token_balance.py``'s check on the same experiment."""

from __future__ import annotations

import json

from realloc.graph.row_deal import deal_rows
from test_token_balance import EXPERIMENT_FILE, logged_rows, logged_tokens, run_balanced

INFERENCE = ("rew_inf", "ref_inf", "critic_inf")
TRAIN = ("actor_train", "critic_train")
N_ITER = 2


def test_train_row_lists_are_dealt_after_the_inference_calls_dispatch(tmp_path):
    run = run_balanced(tmp_path, EXPERIMENT_FILE, True, N_ITER)
    reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines()]
    seen = logged_rows(run)
    for it in range(1, N_ITER + 1):
        mine = [r for r in reqs if r["iteration"] == it]
        calls = {r["label"]: r["req"] for r in mine if r["kind"] == "call"}
        # the train calls' input transfers from the generation (data "<key> -> actor_train")
        train_data = [r["req"] for r in mine if r["kind"] == "data" and r["label"].split(" -> ")[-1] in TRAIN]
        assert train_data and all(c in calls for c in INFERENCE)
        assert max(calls[c] for c in INFERENCE) < min(train_data) < min(calls[c] for c in TRAIN)
        tokens = logged_tokens(run, it - 1)
        for c in TRAIN:  # the lists deal_rows makes of the iteration's lengths, per mini-batch
            assert seen[it - 1, c] == deal_rows(tokens, 2, n_minibatches=2)
        for c in INFERENCE:
            assert seen[it - 1, c] == deal_rows(tokens, 2)
