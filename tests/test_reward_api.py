"""The reward API: the contract (one finite score per sequence; the framework makes the stats), a batched function
of texts and records, a remote reward service over HTTP (a small local http.server on loopback), a weighted mix,
and what `realloc show` checks of them before anything runs."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch

from realloc.algorithms.context import CallContext, CallResult, reward_sums
from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.rewards import reward_fns
from realloc.algorithms.rewards.remote_reward import RemoteReward, RewardServiceError
from realloc.api import INFERENCE, ModelFunctionCallDef
from realloc.graph.dataflow import build_graph
from reward_service import RawService, Service
from spec_helpers import inline_spec


def _seq(lengths: list[int], P: int = 3, T: int = 6) -> dict[str, torch.Tensor]:
    n = len(lengths)
    tokens = torch.arange(n * (P + T)).view(n, P + T) % 50 + 1
    gen_mask = torch.arange(T).view(1, T) < torch.tensor(lengths).view(-1, 1)
    return {"tokens": tokens, "prompt_lens": torch.full((n,), P), "gen_mask": gen_mask, "rows": torch.arange(n)}


def _ctx(name: str, impl: str, args: dict, records=None) -> CallContext:
    call = ModelFunctionCallDef(name=name, model_name="reward", model_type="rule", interface_type=INFERENCE,
                                interface_impl=impl, input_data=["seq"], output_data=["rewards"], interface_args=args)
    return CallContext(call=call, model=None, optimizer=None, config=None, prompt_len=3, gen_len=6, seed=0,
                       iteration=0, ids=range(0, 8), batch_size=8, n_mbs=1, records=records)


LENGTHS = [1, 6, 3, 2, 5, 4, 6, 1]
RECORDS = [{"weight": 0.5 if i % 2 else 2.0, "answer": str(i)} for i in range(8)]


def test_remote_reward_scores_in_order_in_bounded_concurrent_chunks():
    with Service(overlap=2) as svc:  # the first two answer once both are in flight
        ctx = _ctx("rew_inf", "remote_reward", {"url": svc.url, "batch": 3, "concurrency": 2},
                   records=lambda row: RECORDS[row])
        out = reward_fns.remote_scores(ctx, {"seq": _seq(LENGTHS)})
    want = [n * r["weight"] for n, r in zip(LENGTHS, RECORDS)]
    assert out.outputs["rewards"]["score"].tolist() == pytest.approx(want)
    assert sorted(svc.sizes) == [2, 3, 3] and svc.requests == 3  # 8 sequences in requests of at most 3
    assert svc.max_active == 2  # two in flight at once, never more
    assert reward_sums("rew_inf", "remote_reward", out, ["rewards"], 8) == {"score_sum": pytest.approx(sum(want)),
                                                                           "n_seqs_scored": 8.0}


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_a_dead_reward_service_gives_one_error_naming_the_url():
    url = f"http://127.0.0.1:{_dead_port()}/score"
    service = RemoteReward.of("rew_inf", {"url": url, "retries": 2, "backoff": 0.01})
    with pytest.raises(RewardServiceError) as e:
        service.score(["p"], ["r"], [{}])
    assert url in str(e.value) and "failed 3 time(s)" in str(e.value) and "cannot connect" in str(e.value)


def test_slow_answers_time_out_and_are_retried():
    with Service(slow=1, delay=1.5) as svc:  # the first request is slow, the retry fast
        got = RemoteReward.of("r", {"url": svc.url, "timeout": 0.5, "retries": 2, "backoff": 0.01}).score(
            ["p", "q"], [[1, 2], [3]], [{}, {}])
        assert got == [2.0, 1.0] and svc.requests == 2
    with Service(slow=10, delay=1.0) as svc:  # always slow: the error says so, after every try
        with pytest.raises(RewardServiceError, match="no answer within timeout=0.3 s") as e:
            RemoteReward.of("r", {"url": svc.url, "timeout": 0.3, "retries": 1, "backoff": 0.01}).score(
                ["p"], [[1]], [{}])
        assert svc.url in str(e.value) and svc.requests == 2


def test_a_service_that_drips_its_answer_is_cut_off_at_each_requests_deadline():
    """Issue 30, defect 2: headers at once, then a byte a second (every read returns within any socket timeout):
    the call still ends after timeout x (retries + 1) plus the pauses, not when the 60-byte answer is done."""
    body = b'{"scores": [1.0]}'.ljust(60)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n"
    with RawService(head, body, drip=1, pause=1.0) as svc:
        service = RemoteReward.of("rew_inf", {"url": svc.url, "timeout": 1.5, "retries": 1, "backoff": 0.01})
        start = time.monotonic()
        with pytest.raises(RewardServiceError, match=r"failed 2 time\(s\): no answer within timeout=1.5 s") as e:
            service.score(["p"], [[1]], [{}])
        took = time.monotonic() - start
    assert svc.url in str(e.value) and svc.requests == 2
    # 2 x 1.5 s plus a pause of 0.01 s; the answer alone would take a minute. A generous bound, not a timing.
    assert took < 3.0 + 10, took


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "until-close"])
def test_an_answer_over_max_bytes_is_one_error_at_once(length):
    """A valid answer bigger than ``max_bytes`` is refused without reading it whole or trying again, whether the
    service announces its size or streams until it closes."""
    body = b'{"scores": [1.0], "pad": "' + b"x" * 5000 + b'"}'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + (
        b"Content-Length: %d\r\n" % len(body) if length else b"Connection: close\r\n") + b"\r\n"
    with RawService(head, body, drip=1000) as svc:
        with pytest.raises(RewardServiceError, match="over interface_args max_bytes=4096") as e:
            RemoteReward.of("rew_inf", {"url": svc.url, "max_bytes": 4096, "retries": 3}).score(["p"], [[1]], [{}])
        assert svc.url in str(e.value) and svc.requests == 1
    with RawService(head, body) as svc:  # under the default cap the same answer scores
        assert RemoteReward.of("rew_inf", {"url": svc.url}).score(["p"], [[1]], [{}]) == [1.0]


def test_a_wrong_count_of_scores_says_how_many_came_back():
    with Service(score=lambda r, rec: 1.0) as svc:
        short = RemoteReward.of("rew_inf", {"url": svc.url})
        short._parse(b'{"scores": [1.0, 2.0]}', 2)  # the right count parses
        with pytest.raises(RewardServiceError, match=r"answered 1 score\(s\) for 3 sequences") as e:
            short._parse(b'{"scores": [1.0]}', 3)
    assert svc.url in str(e.value)


def test_busy_answers_are_retried_and_client_errors_are_not():
    with Service(fail=2) as svc:  # 503 twice, then scores
        assert RemoteReward.of("r", {"url": svc.url, "retries": 2, "backoff": 0.01}).score(
            ["p"], [[1, 2, 3]], [{}]) == [3.0]
        assert svc.requests == 3
    with Service(fail=5, status=400) as svc:
        with pytest.raises(RewardServiceError, match="refused the request: HTTP 400"):
            RemoteReward.of("r", {"url": svc.url, "retries": 3, "backoff": 0.01}).score(["p"], [[1]], [{}])
        assert svc.requests == 1


def test_batch_reward_gets_texts_records_and_extra_arguments():
    seen = {}

    def score(prompts, responses, records, bonus):
        seen.update(prompts=prompts, responses=responses, records=records)
        return [float(len(r)) + bonus * (rec["answer"] == "3") for r, rec in zip(responses, records)]

    ctx = _ctx("rew_inf", "batch_reward", {"fn": score, "bonus": 10.0}, records=lambda row: RECORDS[row])
    seq = _seq(LENGTHS)
    out = reward_fns.batch_scores(ctx, {"seq": seq})
    want = [n + (10.0 if i == 3 else 0.0) for i, n in enumerate(LENGTHS)]
    assert out.outputs["rewards"]["score"].tolist() == want
    assert seen["records"] == RECORDS and seen["prompts"][1] == seq["tokens"][1, :3].tolist()
    assert seen["responses"][2] == seq["tokens"][2, 3:6].tolist()  # the response's 3 tokens, no padding


def test_verl_compute_score_adapter():
    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return {"score": float(str(solution_str) == ground_truth) + (0.5 if data_source == "b" else 0.0)}

    fn = reward_fns.from_compute_score(compute_score)
    recs = [{"ground_truth": "x", "data_source": "a"}, {"ground_truth": "y", "data_source": "b"}]
    assert fn(["p", "q"], ["x", "z"], recs) == [1.0, 0.5]
    with pytest.raises(ValueError, match="no field 'ground_truth'.*ground_truth='<field>'"):
        fn(["p"], ["x"], [{"answer": "x"}])


def test_mix_rewards_weights_its_two_inputs():
    call = ModelFunctionCallDef(name="mix", model_name="reward", model_type="rule", interface_type=INFERENCE,
                                interface_impl="mix_rewards", input_data=["rule_r", "rm_r"], output_data=["rewards"],
                                interface_args={"weights": [0.7, 0.3]})
    ctx = CallContext(call=call, model=None, optimizer=None, config=None, prompt_len=3, gen_len=6, seed=0,
                      iteration=0, ids=range(3), batch_size=3, n_mbs=1)
    out = reward_fns.mix_scores(ctx, {"rewards": {"score": torch.tensor([1.0, 0.0, 1.0])},
                                      "other": {"score": torch.tensor([2.0, -1.0, 0.5])}})
    assert out.outputs["rewards"]["score"].tolist() == pytest.approx([1.3, -0.3, 0.85])


@pytest.mark.parametrize("score, words", [
    (torch.ones(3), ["call 'rew'", "one score per sequence", "(4,)", "shape (3,)"]),
    (torch.tensor([1.0, float("nan"), 0.0, 1.0]), ["call 'rew'", "non-finite score", "sequence 1"]),
])
def test_the_reward_contract_is_checked(score, words):
    with pytest.raises(ValueError) as e:
        reward_sums("rew", "mine", CallResult({"rewards": {"score": score}}, {}, {}), ["rewards"], 4)
    assert all(w in str(e.value) for w in words), str(e.value)
    # a pipeline stage before the last returns nothing: no stats, no error
    assert reward_sums("rew", "mine", CallResult({}, {}, {}), ["rewards"], 4) == {}


# -- what realloc show checks -----------------------------------------------------------------------------------
def _rpcs(reward_impl: str, args: dict) -> list[ModelFunctionCallDef]:
    return critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=2, reward_impl=reward_impl,
                            reward_args=args)


@pytest.mark.parametrize("impl, args, words", [
    ("remote_reward", {"url": "ftp://x/score"}, ["call 'rew_inf'", "http:// or https://", "ftp://x/score"]),
    ("remote_reward", {"url": "http://127.0.0.1:1/s", "timout": 3}, ["call 'rew_inf'", "['timout']", "timeout"]),
    ("remote_reward", {"url": "http://127.0.0.1:1/s", "retries": -1}, ["'retries'", "zero or more"]),
    ("batch_reward", {"fn": "my_score"}, ["call 'rew_inf'", "interface_args['fn']", "'my_score'"]),
])
def test_show_checks_the_reward_arguments(impl, args, words):
    with pytest.raises(ValueError) as e:
        build_graph(inline_spec(_rpcs(impl, args), ()))
    assert all(w in str(e.value) for w in words), str(e.value)


def _mixed(weights) -> list[ModelFunctionCallDef]:
    """GRPO whose train step reads a mix of the rule's and a reward model's scores."""
    rpcs = _rpcs("rule_reward", {"rule": "token_set", "tokens": [1, 2]})
    rpcs = [dataclasses.replace(r, output_data=["rule_r"]) if r.name == "rew_inf" else r for r in rpcs]
    return rpcs + [
        ModelFunctionCallDef(name="rm_inf", model_name="rm", model_type="tiny-critic", interface_type=INFERENCE,
                             interface_impl="reward", input_data=["seq"], output_data=["rm_r"]),
        ModelFunctionCallDef(name="mix", model_name="reward", interface_type=INFERENCE, interface_impl="mix_rewards",
                             input_data=["rule_r", "rm_r"], output_data=["rewards"],
                             interface_args={"weights": weights})]


def test_a_mixed_reward_graph_validates_and_its_mix_is_the_headline():
    g = build_graph(inline_spec(_mixed([0.8, 0.2]), ()))
    assert g.headline_calls >= {"mix"} and "rew_inf" not in g.headline_calls
    assert {"rew_inf", "rm_inf"} <= set(g.graph.predecessors("mix"))
    with pytest.raises(ValueError, match="call 'mix': mix_rewards needs interface_args\\['weights'\\], two numbers"):
        build_graph(inline_spec(_mixed([1.0]), ()))


def test_evaluation_finds_the_reward_call_by_what_it_writes_not_by_its_key_name():
    from realloc.algorithms.registry import Interface
    from realloc.runtime.inputs.evaluation import eval_calls

    mine = Interface("judge", INFERENCE, lambda ctx, inputs: None, inputs=("seq",), outputs=("verdict:rewards",),
                     head="none")
    rpcs = critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=2, reward_impl="judge")
    rpcs = [dataclasses.replace(r, output_data=["verdicts"]) if r.name == "rew_inf" else
            dataclasses.replace(r, input_data=["seq", "logp", "ref_logp", "verdicts"]) if r.is_train else r
            for r in rpcs]
    spec = inline_spec(rpcs, [mine])
    build_graph(spec)
    ec = eval_calls(spec)
    assert (ec.reward, ec.reward_key) == ("rew_inf", "verdicts")
