"""Small defects earlier audits found and left (leftovers3); each test fails without its fix.

1. Parallel tool calls: a chat model's turn with several calls (Qwen's several ``<tool_call>`` blocks, Llama 3.1's
   JSON objects one after another, Mistral's list) runs them all, in order, each under its own ToolLimits, and
   answers each in the template's own tool message: the conversation equals transformers' ``apply_chat_template``
   of the same two calls and two answers, token for token; inside a GENERATE call every answer token is an
   environment token with exactly zero gradient.
2. `realloc run --launcher slurm --prepare` failing on a full disk leaves the run directory as it was.
3. A run removes the hidden temporary folders of its exports killed with an earlier master.
4. Generation's left-padding mask is in the memory model, once, as the runtime allocates it.
5. A LoRA model trained in bf16 resumes on an fp32 pool as the straight fp32 run (its frozen base included).
"""

from __future__ import annotations

import pytest

from chat_templates import tokenizer_folder
from realloc.envs.tool_env import ToolEnv, check_env_args

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALLS = [("123*45", "5535", "a1b2c3d4e"), ("6*7", "42", "b2c3d4e5f")]  # expression, answer, the call's id
# two calls in one turn as each family's model writes them, and the token that ends the turn
PARALLEL = {
    "llama31": ('{"name": "calculator", "parameters": {"expression": "123*45"}}'
                '{"name": "calculator", "parameters": {"expression": "6*7"}}', "<|eot_id|>"),
    "mistral": ('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "123*45"}, "id": "a1b2c3d4e"}, '
                '{"name": "calculator", "arguments": {"expression": "6*7"}, "id": "b2c3d4e5f"}]', "</s>"),
    "qwen3": ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>', "<|im_end|>"),
}


@pytest.fixture(scope="module")
def folders(hf_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_templates")
    return {f: str(tokenizer_folder(hf_assets.tokenizer, root / f, f)) for f in PARALLEL}


@pytest.mark.parametrize("family", list(PARALLEL))
def test_parallel_tool_calls_all_run_and_are_answered_as_the_template_writes_them(folders, family):
    from chat_templates import round_trip

    env = ToolEnv(tools=["calculator"], call_format="chat", chat_template=folders[family], call_reward=-0.25,
                  limits={"wall_s": 20.0})
    env.reset({"answer": "5535"})
    calls = [{"id": i, "type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
             for e, _, i in CALLS]
    conversation = [{"role": "assistant", "content": "", "tool_calls": calls}] + [
        {"role": "tool", "content": a, "name": "calculator", "tool_call_id": i} for _, a, i in CALLS]
    question = [{"role": "user", "content": "what are 123*45 and 6*7?"}]
    (obs, reward, done), ids, want = round_trip(folders[family], question, TOOLS, *PARALLEL[family], env, conversation)
    assert (reward, done, env.tool_counts["ok"]) == (-0.5, False, 2)  # call_reward per call
    assert ids == want
    assert obs.index("5535") < obs.index("42")  # in the calls' order


def test_each_parallel_call_has_its_own_limits_and_the_turn_at_most_max_calls(folders):
    env = ToolEnv(tools={"calculator": "calculator", "python": "python"}, call_format="chat",
                  chat_template=folders["qwen3"], limits={"wall_s": 3.0}, max_calls=3)
    env.reset({"answer": "1"})
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    slow = call.format("python", '{"code": "import time; time.sleep(2.2); print(7)"}')
    turn = "\n".join([slow, slow, call.format("calculator", '{"expression": "2+3"}'), slow, "<tool_call>{oops"])
    obs, _, _ = env.step(turn)
    # two 2.2 s calls pass a 3 s limit that counts per call (the turn takes longer than one limit), the third runs;
    # the fourth is past max_calls; the unclosed tag after it is text
    assert env.tool_counts["ok"] == 3 and env.tool_counts["timeout"] == 0 and env.tool_counts["error"] == 1
    answers = obs.split("<tool_response>\n")[1:]
    assert [a.split("\n</tool_response>")[0] for a in answers] == \
        ["7", "7", "5", "error: at most 3 tool calls run in one turn (env_args['max_calls'])"]
    # malformed and unknown calls are each answered, in place
    obs, _, _ = env.step(call.format("nope", "{}") + "\n<tool_call>\n{x}\n</tool_call>\n" +
                         call.format("calculator", '{"expression": "1+1"}'))
    answers = [a.split("\n</tool_response>")[0] for a in obs.split("<tool_response>\n")[1:]]
    assert answers[0].startswith("error: no tool 'nope'") and answers[1].startswith("error: the tool call is not JSON")
    assert answers[2] == "2"
    with pytest.raises(ValueError, match=r"max_calls must be a positive integer"):
        check_env_args("gen", {"tools": ["calculator"], "max_calls": 0})


# 2. `realloc run --launcher slurm --prepare` failing on a full disk half way (the run's secret, after the plan,
#    run.json and config/ are written) leaves the run directory as it was: gone if it created it, else the same files
#    with the same bytes (a rewritten run.json and a removed secret given back, what it added removed).

def _tree(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_a_prepare_that_fails_on_a_full_disk_removes_what_it_wrote_and_keeps_what_was_there(tmp_path, monkeypatch,
                                                                                                capsys):
    import errno
    import os
    from pathlib import Path

    from test_launcher import whole_cluster_plan

    from realloc.cli import main
    from realloc.runtime.wire import protocol

    repo = Path(__file__).resolve().parents[1]
    exp = str(repo / "experiments/ppo_tiny.py")
    whole_cluster_plan(exp, dp=2, tp=1).save(tmp_path / "plan.json")
    argv = ["run", exp, "--plan", str(tmp_path / "plan.json"), "--iterations", "3", "--launcher", "slurm",
            "--prepare", "--no-tensorboard", "--run-dir"]
    real = protocol.write_secret_file

    def full(path, secret):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(protocol, "write_secret_file", full)
    fresh = tmp_path / "runs" / "a"
    assert main(argv + [str(fresh)]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [f"realloc run: error: {fresh / 'secret'}: No space left on device"]
    assert not (tmp_path / "runs").exists()  # nothing it created is left
    # a directory an earlier prepare wrote, with a file of the user's
    monkeypatch.setattr(protocol, "write_secret_file", real)
    used = tmp_path / "used"
    assert main(argv[:-1] + ["--iterations", "2", "--run-dir", str(used)]) == 0
    (used / "notes.txt").write_text("mine")
    before = _tree(used)
    assert "secret" in before and "run.json" in before and "job.sbatch" in before
    monkeypatch.setattr(protocol, "write_secret_file", full)
    capsys.readouterr()
    assert main(argv + [str(used)]) == 1
    assert len([ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]) == 1
    assert _tree(used) == before
    assert (os.stat(used / "secret").st_mode & 0o777) == 0o600


# 3. A master killed during an --export-every export leaves the export's hidden temporary folder (as large as the
#    model); only the next export to the same folder removed it, and a resumed run exports to other folders.

def test_a_run_removes_the_hidden_folders_of_its_killed_exports_and_no_one_else_s(tmp_path):
    import os
    import socket
    import subprocess

    from test_audit_round10 import _fake_run

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone
    host = socket.gethostname()
    exports = tmp_path / "exports"
    stale = [exports / "iter_00000001" / f".actor.part-{host}-{dead.pid}-0a1b",
             exports / "iter_00000002" / f".critic.part-{host}-{dead.pid}-2c3d",
             exports / "replaced-20260101-000000" / "iter_00000001" / f".actor.part-{host}-{dead.pid}-4e5f"]
    kept = [exports / "iter_00000002" / f".actor.part-{host}-{os.getpid()}-6a7b",  # a live export's
            exports / "iter_00000002" / f".actor.part-other-host-{dead.pid}-8c9d",  # another machine's
            exports / "iter_00000002" / "critic"]  # a finished export
    for p in stale + kept:
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"x" * 100)
    assert _fake_run(tmp_path) is None  # a run with no export at all sweeps its run directory's exports
    assert [p.exists() for p in stale] == [False] * 3
    assert [p.exists() for p in kept] == [True] * 3
    assert not (exports / "iter_00000001").exists()  # left empty by the sweep


# 4. Generation's left-padding mask (llama.cache_mask, [rows, 1, P, P] bool for the prefill) was in no memory
#    estimate, and every micro-batch built its own up front, so all of them were alive at once.

from test_kv_alloc_cost import tiny_model  # noqa: E402,F401  (a tp 1 tiny model in this process)


def test_the_prefill_s_padding_mask_is_in_the_memory_model_as_the_runtime_allocates_it(monkeypatch, tiny_model):
    import dataclasses
    import weakref

    from realloc.api import InterfaceType as I
    from realloc.estimator.hardware import Precision
    from realloc.estimator.mask_memory import stage_mask_bytes
    from realloc.models import generation
    from realloc.models.config import get_model_config
    from realloc.models.sampling import GenerationConfig

    # hand-computed, tiny in bf16, 2 rows of 32-token prompts: the [2, 1, 32, 32] bool mask (2048 bytes) and one
    # layer's bf16 copy (4096); a window of 16 adds its own [2, 1, 32, 32] mask beside it
    tiny, bf16 = get_model_config("tiny"), Precision.for_dtype("bf16")
    assert stage_mask_bytes(tiny, I.GENERATE, 2, 32, (2, 64), bf16, 4, 1, False) == 2 * 32 * 32 + 2 * 32 * 32 * 2
    window = dataclasses.replace(tiny, sliding_window=16)
    assert stage_mask_bytes(window, I.GENERATE, 2, 32, (2, 64), bf16, 4, 1, False) == 2 * 32 * 32 * 2 + 4096
    # what a real generation allocates: 6 prompts (longest 6 in each micro-batch of 2 rows) in 3 micro-batches
    live, peak = [0], [0]

    def counted(key_valid, query_start, n_queries):
        mask = real(key_valid, query_start, n_queries)
        if n_queries > 1:  # the prefill's (the decode steps' are one query wide)
            live[0] += mask.numel() * mask.element_size()
            peak[0] = max(peak[0], live[0])
            weakref.finalize(mask, lambda n=mask.numel() * mask.element_size(): live.__setitem__(0, live[0] - n))
        return mask

    real = generation.cache_mask
    monkeypatch.setattr(generation, "cache_mask", counted)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [1, 2, 3, 4, 5, 6], [9], [5, 4, 3, 2, 1, 7], [3, 3, 3]]
    generation.generate(tiny_model, prompts, GenerationConfig(max_new_tokens=3, seed=3, eos_token_ids=(0,)), n_mbs=3)
    assert peak[0] == 2 * 6 * 6  # one micro-batch's mask at a time (it was 3 of them)
    padding = stage_mask_bytes(tiny, I.GENERATE, 2, 6, (2, 9), Precision.for_dtype("fp32"), 4, 1, False)
    assert padding - 2 * 6 * 6 * 4 == peak[0]  # the estimate's bool mask is what was alive; the rest its fp32 copy


# 5. A LoRA model trained in bf16 and resumed on an fp32 pool: its frozen base (no fp32 masters) kept the bf16
#    rounding, where the straight run on the fp32 pool holds the base itself. The resumed state must be the straight
#    fp32 run's base, the bf16 run's fp32 masters as adapters, and their Adam state.

def _lora_model(dtype):
    import dataclasses

    import torch.distributed as dist

    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.models.lora_config import LoRAConfig
    from realloc.strategy import ParallelStrategy

    assert dist.is_initialized()  # the tiny_model fixture's one-rank gloo group
    cfg = dataclasses.replace(get_model_config("tiny"), lora=LoRAConfig(rank=4))
    layout = ModelLayout.for_model(cfg, (0,), ParallelStrategy(1, 1, 1))
    cache = ProcessGroupCache()
    cache.ensure_layouts([layout])
    model = ParallelModel(cfg, cache.model_groups(layout), dtype=dtype, init="random", seed=3)
    return model, model.make_optimizer(0.05)


def test_a_lora_model_trained_in_bf16_resumes_on_an_fp32_pool_as_the_straight_fp32_run(tmp_path, tiny_model):
    import torch

    from realloc.runtime.persist import checkpoint as C

    bf16, opt = _lora_model(torch.bfloat16)
    trained = bf16.trained_params()
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        opt.step_with({n: torch.randn(p.shape, generator=g) for n, p in trained.items()})
    tmp = C.begin(tmp_path, 2)
    C.save_model_shard(tmp, "actor", 0, 0, "cpu0 dp1·tp1·pp1", bf16.params(), opt, tp_pp=(1, 1))
    ckpt = C.commit(tmp, tmp_path, 2, {"next_iteration": 2}, "{}")
    resumed, resumed_opt = _lora_model(torch.float32)
    C.load_model_shard(ckpt, "actor", 0, 0, "cpu1 dp1·tp1·pp1", resumed.params(), resumed_opt, tp_pp=(1, 1))
    straight, _ = _lora_model(torch.float32)  # the fp32 pool's model made from the same source
    base = [n for n in resumed.params() if n not in trained]
    assert base and set(trained) and len(base) + len(trained) == len(resumed.params())
    rounded = 0
    for n in base:
        p = resumed.params()[n]
        assert p.dtype == torch.float32 and torch.equal(p, straight.params()[n]), n
        rounded += not torch.equal(p, bf16.params()[n].float())  # what the old resume kept
    assert rounded > 0
    for n, p in resumed.trained_params().items():
        assert torch.equal(p, opt.masters[n]), n
        want, got = opt.inner.state[opt.masters[n]], resumed_opt.state[p]
        assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want), n
    # the other way: an fp32 checkpoint on a bf16 pool is the straight bf16 run's base (its source, rounded)
    tmp = C.begin(tmp_path, 3)
    C.save_model_shard(tmp, "actor", 0, 0, "cpu1 dp1·tp1·pp1", resumed.params(), resumed_opt, tp_pp=(1, 1))
    ckpt = C.commit(tmp, tmp_path, 3, {"next_iteration": 3}, "{}")
    back, back_opt = _lora_model(torch.bfloat16)
    C.load_model_shard(ckpt, "actor", 0, 0, "cpu0 dp1·tp1·pp1", back.params(), back_opt, tp_pp=(1, 1))
    assert all(torch.equal(back.params()[n], bf16.params()[n]) for n in base)


# 1b. Parallel calls inside a GENERATE call: both answers of each turn are environment tokens, and the gradient of
#     every environment token's log-prob is exactly zero (the multi-turn machinery of tests/test_multiturn.py).

@pytest.fixture(scope="module")
def mt_pool(tmp_path_factory):
    from mp_pool import GlooPool

    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def test_parallel_calls_in_a_rollout_are_environment_tokens_with_zero_gradient(mt_pool, tmp_path_factory):
    import torch

    from multiturn_cases import CHARACTERS
    from test_multiturn import N, PROMPTS, _gathered, _generate, _runs, _train_grads

    from realloc.data.tokenizer import Tokenizer
    from realloc.demo.arith_task import train_tokenizer

    tokenizer_dir = str(train_tokenizer(tmp_path_factory.mktemp("tok"), CHARACTERS))
    env = {"env": "multiturn_cases:make_parallel", "env_args": {"turns": 3}, "max_turns": 3, "turn_tokens": 8}
    got = _gathered(mt_pool.run(_generate, tokenizer_dir, 1, 1, 1, env))
    tok = Tokenizer.load(tokenizer_dir)
    answered = 0
    for b in range(N):
        plen, k = len(PROMPTS[b]), int(got["gen_mask"][b].sum())
        runs = _runs(got["tokens"][b, plen:plen + k].tolist(), got["loss_mask"][b, :k].tolist())
        for i, (is_policy, toks) in enumerate(runs[:-1]):
            if is_policy and not runs[i + 1][0]:  # the observation after a policy turn: both calls' answers
                n = len(tok.decode(toks))
                want = tok.encode(f"<{n}><{n + 1}>", add_special_tokens=False)
                assert runs[i + 1][1] == want[:len(runs[i + 1][1])]
                answered += 1
    assert answered > 0 and got["sums"][0]["tool_ok"] == 2 * answered
    seq = {"tokens": got["tokens"], "gen_mask": got["gen_mask"], "loss_mask": got["loss_mask"],
           "prompt_lens": torch.tensor([len(p) for p in PROMPTS])}
    grads, _ = mt_pool.run(_train_grads, tokenizer_dir, {"seq": seq, "logp": got["logp"]}, "grpo")[0]
    grad = grads[0]
    for b in range(N):
        plen, k = len(PROMPTS[b]), int(got["gen_mask"][b].sum())
        policy = got["loss_mask"][b, :k]
        assert (grad[b, plen:plen + k][~policy] == 0).all() and (grad[b, plen:plen + k][policy] != 0).all()
