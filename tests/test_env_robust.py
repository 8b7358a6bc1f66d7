"""Robustness of multi-turn environments and the tool sandbox (docs/multi-turn.md, "How a tool is contained"):
a tool's files are capped in total, not only per file; a sandbox that cannot start a tool (no space, a failed fork
or exec) is an observation and a counted status, and stops the run only when every call fails so; a huge
observation is cut before it is tokenized, to the very tokens tokenize-then-cut gives."""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile

import pytest

from realloc.envs.tool_health import INFRA_STREAK, InfraWatch
from realloc.tools.sandbox import Sandbox, ToolLimits, _verdict, network_isolation
from tests.test_multiturn import N, pool, tokenizer_dir  # noqa: F401  (the fixtures: 2 gloo ranks, the tokenizer)

WRITER = "for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20))\nprint('wrote', i + 1)"


# -- the total of a tool's files --------------------------------------------------------------------------------
def test_a_tool_that_writes_many_files_is_stopped_at_the_total_cap_and_one_under_it_is_not():
    # each file (4 MB) is under file_mb; 20 of them (80 MB) filled the disk before, with no total cap
    sandbox = Sandbox(ToolLimits(file_mb=8, disk_mb=12, wall_s=20, cpu_s=10), network_isolation())
    r = sandbox.run("realloc.tools.builtin:python", WRITER)
    assert (r.status, r.text) == ("disk", "error: the tool wrote more than 12 MB of files and was stopped")
    roomy = Sandbox(ToolLimits(file_mb=8, disk_mb=100, wall_s=20, cpu_s=10), network_isolation())
    assert roomy.run("realloc.tools.builtin:python", WRITER).text == "wrote 20\n"
    assert sandbox.run("realloc.tools.builtin:calculator", "6*7").text == "42"  # and the next call works


def test_empty_files_count_too():
    # 100 000 empty files take no block but an inode each: a disk's inodes run out before its bytes
    program = "for i in range(100000):\n    open(f'e{i}', 'w').close()\nprint('made', i + 1)"
    r = Sandbox(ToolLimits(disk_mb=4, wall_s=20, cpu_s=10), network_isolation()).run(
        "realloc.tools.builtin:python", program)
    assert (r.status, r.text) == ("disk", "error: the tool wrote more than 4 MB of files and was stopped")


def test_the_total_cap_is_a_checked_limit():
    assert ToolLimits().disk_mb == 64
    with pytest.raises(ValueError, match="ToolLimits.disk_mb must be a positive number, got 0"):
        ToolLimits(disk_mb=0)
    with pytest.raises(ValueError, match="env: unknown tool limit"):
        ToolLimits.of("env", {"disk": 1})


# -- the sandbox's own failures -----------------------------------------------------------------------------------
def _no_space(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _no_fork(*_a, **_k):
    raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")


@pytest.mark.parametrize("target, fail, words", [
    (tempfile, ("mkdtemp", _no_space), "OSError: [Errno 28] No space left on device"),
    (subprocess, ("Popen", _no_fork), "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
])
def test_a_sandbox_that_cannot_start_the_tool_answers_with_an_observation(monkeypatch, target, fail, words):
    monkeypatch.setattr(target, *fail)
    r = Sandbox(ToolLimits(), "socket_block").run("realloc.tools.builtin:calculator", "1+1")
    assert (r.status, r.text) == ("infra", "error: the tool could not be started: " + words)


def test_a_result_line_cannot_claim_an_infra_failure():
    # a tool that found its call's marker (its caller's frames) must not stop the run by forging "infra" 8 times
    line = '\n\x00m {"ok": false, "error": "BlockingIOError: [Errno 11]", "infra": true}\n'
    assert _verdict(0, line, "\x00m", ToolLimits())[0] == "error"


def test_a_failed_exec_is_counted_by_the_tool_environment_which_goes_on():
    from realloc.envs.tool_env import ToolEnv
    from tests.env_robust_cases import NoExec

    env = ToolEnv()
    env.reset({"answer": "2"})
    good, env.sandbox = env.sandbox, NoExec(ToolLimits())
    obs, _, done = env.step("<calculator>1+1</calculator>")
    assert not done and obs.startswith("<result>error: the tool could not be started: FileNotFoundError")
    env.sandbox = good
    assert env.step("<calculator>1+1</calculator>")[0] == "<result>2</result>"
    assert env.tool_counts["infra"] == 1 and env.tool_counts["ok"] == 1 and env.infra_error.startswith("error: ")


class _Env:
    def __init__(self) -> None:
        self.tool_counts = {"ok": 0, "infra": 0}
        self.infra_error = ""


def test_the_run_stops_after_a_streak_of_infra_failures_and_any_started_call_resets_it():
    envs = [_Env(), _Env()]
    watch = InfraWatch()

    def turn(infra: int, ok: int) -> None:
        before = watch.counts(envs)
        envs[0].tool_counts["infra"] += infra
        envs[1].tool_counts["ok"] += ok
        if infra:
            envs[0].infra_error = "error: the tool could not be started: OSError: [Errno 28] No space left on device"
        watch.turn("call 'gen'", envs, before)

    turn(INFRA_STREAK - 1, 0)
    turn(INFRA_STREAK - 1, 1)  # a call that started: the count starts again
    turn(0, 0)
    with pytest.raises(RuntimeError) as e:
        turn(1, 0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"call 'gen': the last {INFRA_STREAK} tool calls could not be started")
    assert "OSError: [Errno 28] No space left on device" in msg


# -- inside a GENERATE call ---------------------------------------------------------------------------------------
def _run(ctx, tokenizer_dir: str, env: dict):
    from tests.test_multiturn import ENV, _generate

    try:
        got = _generate(ctx, tokenizer_dir, 1, 1, 1, {**ENV, **env})  # on rank 0; None on the other
        return None if got is None else got["sums"]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_infra_failures_are_observations_until_every_call_fails(pool, tokenizer_dir):
    # 4 rollouts, 3 tool turns each: the first and third calls fail, the second starts; every rollout goes on
    env = {"env": "env_robust_cases:make_infra", "max_turns": 4}
    sums = pool.run(_run, tokenizer_dir, {**env, "env_args": {"turns": 4, "every_other": True}})[0]
    assert isinstance(sums, dict), sums
    assert sums["tool_infra"] == 8 and sums["tool_ok"] == 4 and sums["env_obs_steps"] == 12
    # every call fails: the call stops after INFRA_STREAK of them (the second turn), naming the cause in one line
    err = pool.run(_run, tokenizer_dir, {**env, "env_args": {"turns": 4}})[0]
    assert err.startswith(f"RuntimeError: call 'actor_gen': the last {INFRA_STREAK} tool calls could not be "
                          f"started (the machine, not the tools: the tool could not be started: FileNotFoundError")
    assert "\n" not in err


# -- a huge observation -------------------------------------------------------------------------------------------
class _Spy:
    """A tokenizer that records the longest text it was given."""

    def __init__(self, tok) -> None:
        self.tok, self.longest = tok, 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The kinds the project loads: one token per character (the demos'), a byte-level BPE with Qwen2's
    pre-tokenization (tiny_assets), and a SentencePiece-style BPE with no pre-tokenizer, spaces written as "▁" by
    the normalizer (Llama 2's and Mistral's tokenizer.json), both trained on the tiny corpus."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, normalizers, trainers

    from realloc.data.tokenizer import Tokenizer
    from realloc.demo.arith_task import train_tokenizer as train_chars
    from realloc.tiny_assets import hf as tiny_hf
    from realloc.tiny_assets.text import corpus
    from tests.multiturn_cases import CHARACTERS

    tmp = tmp_path_factory.mktemp("toks")
    (tmp / "corpus.txt").write_text(corpus())
    chars = Tokenizer.load(str(train_chars(tmp / "chars", CHARACTERS)))
    bpe = Tokenizer.load(str(tiny_hf.train_tokenizer(tmp / "corpus.txt", tmp / "bpe", vocab_size=500)))
    sp = Raw(models.BPE(unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " ")])
    sp.train_from_iterator(corpus().splitlines(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                                     show_progress=False))

    class SP:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return sp.encode(text, add_special_tokens=add_special_tokens).ids

    return {"chars": chars, "bpe": bpe, "sentencepiece": SP()}


def _texts() -> list[str]:
    import random

    from realloc.tiny_assets.text import corpus

    r = random.Random(0)
    story = corpus(seed=3, n_paragraphs=40)
    pool = ["ab", "  ", "\n", "\n\n", " 12345", "x=y+1", "...", "é", "e\u0301", "日本語", "🙂", "\t", "'s", " 'll"]
    mixed = "".join(r.choice(pool) + r.choice(["", " "]) for _ in range(3000))
    return [story, mixed, "word " * 2000, "a" * 6000 + " b" * 400, "1234567890" * 600, " " * 5000 + "x y" * 300,
            "z" * 20000]


@pytest.mark.parametrize("kind", ["chars", "bpe", "sentencepiece"])
def test_a_cut_observation_gives_the_tokens_of_tokenize_then_cut(tokenizers, kind):
    from realloc.envs.observation_cut import cut_observation

    tok = tokenizers[kind]
    for text in _texts():
        for budget in (0, 1, 7, 40, 150):
            cut = cut_observation(tok, text, budget)
            assert text.startswith(cut)
            whole = tok.encode(text, add_special_tokens=False)[:budget]
            assert tok.encode(cut, add_special_tokens=False)[:budget] == whole, (kind, text[:20], budget)


def test_a_100_mb_observation_is_tokenized_by_a_window_the_budget_bounds(tokenizers):
    from realloc.envs.observation_cut import cut_observation

    spy = _Spy(tokenizers["bpe"])
    text = "The tool printed 12 lines. " * 4_000_000  # 108 MB
    cut = cut_observation(spy, text, 100)
    assert spy.longest <= 16 * (100 + 64) and len(cut) <= spy.longest
    assert spy.encode(cut, add_special_tokens=False)[:100] == spy.encode(text[:5000], add_special_tokens=False)[:100]


def _huge_run(ctx, tokenizer_dir: str, chars: int, first: bool):
    """A multi-turn call whose environment answers with ``chars`` characters (its first observation too when
    ``first``), its tokenizer a spy: the longest text it was given, and the rollouts."""
    from realloc.algorithms.critic_free.grpo import GRPOConfig
    from realloc.algorithms.critic_free.multiturn import multiturn_generate
    from realloc.calls import GENERATE, ModelFunctionCallDef
    from realloc.data.tokenizer import Tokenizer
    from realloc.models.config import get_model_config
    from tests.model_helpers import build_model
    from tests.test_multiturn import ENV, _ctx, _prompts

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 1, seed=5)
    if model is None:  # the pool's other rank
        return None
    tok = Tokenizer.load(tokenizer_dir)
    spy = _Spy(tok)
    spy.decode = tok.decode
    for name in ("eos_token_ids", "pad_token_id", "vocab_size"):
        setattr(spy, name, getattr(tok, name))
    env = {**ENV, "env": "env_robust_cases:make_huge", "env_args": {"chars": chars, "turns": 3, "first": first}}
    call = ModelFunctionCallDef(name="actor_gen", model_name="actor", interface_type=GENERATE,
                                interface_impl="grpo_multiturn", interface_args=env)
    out = multiturn_generate(_ctx(model, spy, call, 0, N, GRPOConfig()), {"prompts": _prompts(0, N)})
    return spy.longest, out.outputs["seq"]


@pytest.mark.parametrize("first", [True, False])
def test_a_huge_observation_in_a_multiturn_call_is_cut_before_it_is_tokenized(pool, tokenizer_dir, first):
    from realloc.data.tokenizer import Tokenizer
    from tests.env_robust_cases import huge
    from tests.test_multiturn import PROMPTS, T, _runs

    longest, seq = pool.run(_huge_run, tokenizer_dir, 5_000_000, first)[0]
    assert longest <= 16 * (T + 64)  # not the 5 MB the environment answered with
    tok = Tokenizer.load(tokenizer_dir)
    for b in range(N):
        plen, k = len(PROMPTS[b]), int(seq["gen_mask"][b].sum())
        assert k == T  # the observation filled the budget
        runs = _runs(seq["tokens"][b, plen:plen + k].tolist(), seq["loss_mask"][b, :k].tolist())
        # the first observation, or "<>" and the policy's first turn, then the first step's observation to the end
        assert [p for p, _ in runs] == ([False] if first else [False, True, False])
        assert runs[-1][1] == tok.encode(huge(1000, 0 if first else 1), add_special_tokens=False)[:len(runs[-1][1])]


# writes 80 MB under a folder it keeps unreadable (chmod 000) but for the moment of each write: a parent that is not
# root (it owns the folder) opened it neither to count nor to remove it
HIDER = ("import os\nos.makedirs('a/b')\nfor i in range(20):\n    os.chmod('a', 0o700)\n"
         "    open(f'a/b/f{i}', 'wb').write(b'x' * (4 << 20))\n    os.chmod('a', 0)\nprint('hid')")


def test_files_in_a_folder_the_tool_made_unreadable_count_and_are_removed():
    import glob

    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "realloc-tool-*")))
    small = Sandbox(ToolLimits(file_mb=8, disk_mb=12, wall_s=20, cpu_s=10), network_isolation())
    assert small.run("realloc.tools.builtin:python", HIDER).status == "disk"
    roomy = Sandbox(ToolLimits(file_mb=8, disk_mb=100, wall_s=20, cpu_s=10), network_isolation())
    assert roomy.run("realloc.tools.builtin:python", HIDER).text == "hid\n"
    # the locked folders went with the calls' working folders
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "realloc-tool-*"))) <= before
