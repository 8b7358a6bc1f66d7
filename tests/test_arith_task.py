"""The arithmetic demo task: its problems and splits, shipped files, tokenizer, verifiable reward and the
transformers accuracy evaluator, each against hand-computed values or an unbatched reference."""

from __future__ import annotations

import json

import pytest
import torch

from hf_assets import REPO
from realloc.algorithms.rewards.text_rules import exact_number_match, first_number
from realloc.demo import arith_task


def _solve(prompt: str) -> str:
    """Independent of the generator: parse "a+b=" / "a-b=" and compute."""
    body = prompt.removesuffix("=")
    op = "+" if "+" in body else "-"
    a, b = (int(x) for x in body.split(op))
    return str(a + b if op == "+" else a - b)


@pytest.fixture(scope="module")
def arith_tok(tmp_path_factory):
    return arith_task.train_tokenizer(tmp_path_factory.mktemp("arith") / "tok")


def test_problems_and_disjoint_splits():
    every = arith_task.problems()
    assert len(every) == 100 * 100 + 100 * 101 // 2  # a+b for all pairs, a-b for a >= b
    assert len(set(p for p, _ in every)) == len(every) and all(_solve(p) == a for p, a in every)
    parts = arith_task.split(arith_task.Split(seed=3, n_eval=50, n_sft=60, n_train=70))
    assert [len(parts[k]) for k in ("eval", "sft", "train")] == [50, 60, 70]
    seen = [set(p for p, _ in parts[k]) for k in ("eval", "sft", "train")]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert parts == arith_task.split(arith_task.Split(seed=3, n_eval=50, n_sft=60, n_train=70))
    assert parts["eval"] != arith_task.split(arith_task.Split(seed=4, n_eval=50, n_sft=60, n_train=70))["eval"]
    with pytest.raises(ValueError, match=r"arith_task.split: 15000 \+ 100 \+ 0 problems asked for, but the task "
                                         r"has only 15050"):
        arith_task.split(arith_task.Split(n_eval=15000, n_sft=100, n_train=0))


def test_shipped_files_equal_the_generator():
    data = REPO / "experiments" / "data"
    for name, text in arith_task.files().items():
        assert (data / name).read_text(encoding="utf-8") == text, f"re-make with python -m realloc.demo.arith_task " \
                                                                  f"data --out experiments/data"
    for line in (data / arith_task.EVAL_FILE).read_text().splitlines()[:50]:
        rec = json.loads(line)
        assert _solve(rec["prompt"]) == rec["answer"]
    pairs = [json.loads(line) for line in (data / arith_task.PAIRS_FILE).read_text().splitlines()]
    sft = [json.loads(line) for line in (data / arith_task.SFT_FILE).read_text().splitlines()]
    assert len(pairs) == arith_task.Split().n_pairs and [p["prompt"] for p in pairs] == [r["prompt"] for r in
                                                                                          sft[:len(pairs)]]
    copied = 0
    for p in pairs:  # the right answer over a wrong one: a number of the question, or one digit off by one
        operands = p["prompt"].rstrip("=").replace("-", "+").split("+")
        assert p["chosen"] == _solve(p["prompt"]) and p["rejected"] != p["chosen"] and int(p["rejected"]) >= 0
        copied += p["rejected"] in operands
        assert p["rejected"] in operands or abs(int(p["rejected"]) - int(p["chosen"])) in (1, 10), p
    assert 0.4 < copied / len(pairs) < 0.6
    padded = [json.loads(line) for line in (data / arith_task.PADDED_FILE).read_text().splitlines()]
    assert [r["prompt"] for r in padded] == [r["prompt"] for r in sft]
    n_padded = 0
    for a, b in zip(sft, padded):  # the same answer, three digits wide or as it is
        assert b["response"] in (a["response"], a["response"].zfill(3))
        n_padded += b["response"] != a["response"]
    short = sum(len(r["response"]) < 3 for r in sft)
    assert abs(n_padded / short - arith_task.Split().pad_share) < 0.03


@pytest.mark.parametrize("which", ["trained", "shipped"])
def test_tokenizer_one_token_per_character(arith_tok, which):
    """A freshly trained tokenizer, and the one shipped for the experiments (``experiments/data/arith_tokenizer``,
    re-made by ``python -m realloc.demo.arith_task tokenizer --out experiments/data/arith_tokenizer``)."""
    from transformers import AutoTokenizer

    from realloc.data.tokenizer import Tokenizer

    if which == "shipped":
        shipped = REPO / "experiments" / "data" / "arith_tokenizer"
        fresh = json.loads((arith_tok / "tokenizer.json").read_text())
        assert json.loads((shipped / "tokenizer.json").read_text()) == fresh
        assert (shipped / "generation_config.json").read_text() == (arith_tok / "generation_config.json").read_text()
        arith_tok = shipped
    hf = AutoTokenizer.from_pretrained(str(arith_tok), local_files_only=True)
    # lexicographic ids after the 4 special tokens: " "=4 "+"=5 "-"=6 "0".."9"=7..16 "="=17
    assert hf("23+9= 0-1")["input_ids"] == [1, 9, 10, 5, 16, 17, 4, 7, 6, 8]
    assert hf.decode([9, 10, 2, 0, 0], skip_special_tokens=True) == "23"
    assert hf("23x", add_special_tokens=False)["input_ids"] == [9, 10, 3]  # unknown characters: <|unk|>
    tok = Tokenizer.load(arith_tok)
    assert (tok.vocab_size, tok.eos_token_ids, tok.pad_token_id, tok.bos_token_id) == (18, (2,), 0, 1)


@pytest.mark.parametrize("response, answer, want", [
    ("32", "32", 1.0), ("32<|eos|>", "32", 1.0), (" 32 \n", "32", 1.0), ("32<|eos|><|pad|>", " 32 ", 1.0),
    ("32 33", "32", 1.0), ("31", "32", 0.0), ("3", "32", 0.0), ("321", "32", 0.0), ("032", "32", 0.0),
    ("", "32", 0.0), ("<|eos|>", "0", 0.0), ("-5", "-5", 1.0), ("5", "-5", 0.0), ("x=7", "7", 1.0),
])
def test_exact_number_match(response, answer, want):
    assert exact_number_match("23+9=", response, answer) == want


def test_first_number():
    assert (first_number("a 12 b 3"), first_number("no digits"), first_number("--4")) == ("12", None, "-4")


def test_accuracy_equals_unbatched_greedy_decoding(tmp_path, arith_tok):
    from transformers import AutoModelForCausalLM

    from realloc.demo.accuracy import exact_match_accuracy, main
    from realloc.tiny_assets.hf import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", vocab_size=32, hidden=64, layers=2, heads=4, kv_heads=2,
                                intermediate=128, seed=4, tokenizer_dir=arith_tok, init_std=0.3)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), local_files_only=True).eval()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(arith_tok), local_files_only=True)
    prompts = ["1+2=", "45+67=", "9-3=", "99-10=", "50+5=", "7+70=", "12-12=", "3+33="]
    records, want, want_value = [], 0, 0
    for i, p in enumerate(prompts):  # one prompt at a time: no padding
        ids = torch.tensor([hf(p)["input_ids"]])
        with torch.no_grad():
            out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=4, eos_token_id=2, pad_token_id=0)
        number = first_number(hf.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        right = number is not None and i % 2 == 0  # half the answers are what the model says
        # a quarter are its value written another way: right value, not an exact match
        padded = number is not None and i % 4 == 1 and not number.startswith("-")
        want += right
        want_value += right or padded
        records.append({"prompt": p, "answer": number if right else "00" + number if padded else "1000"})
    assert want >= 2 and want_value > want  # the model writes numbers: the test tells the counts apart
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    acc = exact_match_accuracy(ckpt, path, max_new_tokens=4, batch_size=3)
    assert (acc.n, acc.correct, acc.right_value) == (len(prompts), want, want_value)
    assert main([str(tmp_path), str(path)]) == 2  # not a checkpoint: one error line
