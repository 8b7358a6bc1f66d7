"""Small frictions of a newcomer's first hour (issue 30, newcomer item 7), each checked where a user meets it:
a misspelt command, the search's help, a plan with no memory to spare, models of different vocabularies, and a
tokenizer that defines a BOS token but does not add it to plain text."""

from __future__ import annotations

import json
import re
import shutil
import textwrap

from realloc.api import load_experiment
from realloc.cli import build_parser, main
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from run_helpers import TINY, disjoint_plan


def test_a_misspelt_command_gets_did_you_mean(capsys):
    assert main(["serach", "experiments/grpo_tiny.py"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("realloc: error: unknown command 'serach'; did you mean 'search'?"), line
    assert main(["frobnicate"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "unknown command 'frobnicate'" in line and "did you mean" not in line and "search" in line


def test_search_help_names_the_search_time_option_only():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    text = sub.choices["search"].format_help()
    assert "--search-time" in text and not re.search(r"(?<![-\w])--time\b", text)


def test_a_plan_at_the_limit_of_usable_memory_gets_a_warning():
    graph = build_graph(load_experiment(TINY))
    plan = disjoint_plan()
    usable = 8 * 2**30
    warn = [plan.model_copy(update={"estimated_peak_memory": int(f * usable)}).memory_warning(usable)
            for f in (1.0, 0.96, 0.9)]
    assert warn[0] is not None and "(100%)" in warn[0] and "usable_memory_fraction" in warn[0]
    assert warn[1] is not None and "(96%)" in warn[1]
    assert warn[2] is None
    assert ExecutionPlan.by_hand(graph, {c: p for c, p in plan.placements.items()}).memory_warning(usable) is None


def test_show_warns_once_about_different_vocabularies_and_a_tokenizer_that_adds_no_bos(hf_assets, tmp_path, capsys):
    from transformers import AutoTokenizer

    # the actor's tokenizer with its BOS post-processor taken out (its config still names <|bos|>)
    actor = tmp_path / "actor"
    shutil.copytree(hf_assets.checkpoint("llama", layers=2), actor)
    tok = json.loads((actor / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (actor / "tokenizer.json").write_text(json.dumps(tok))
    ref = hf_assets.checkpoint("llama", layers=2, vocab_size=640)
    hf = AutoTokenizer.from_pretrained(str(actor), local_files_only=True)
    assert hf.bos_token == "<|bos|>" and hf("What is 7 plus 4?")["input_ids"][0] != hf.bos_token_id  # the reference
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "What is 7 plus 4?"}\n{"prompt": "Hi"}\n')
    exp = tmp_path / "exp.py"
    exp.write_text(textwrap.dedent(f"""\
        import dataclasses
        from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
        from realloc.api import auto

        @auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=2, prompt_len=16, gen_len=8)
        @dataclasses.dataclass
        class Exp:
            dataset: str = "prompts.jsonl"
            grpo: GRPOConfig = GRPOConfig()
            models = {{"actor": {str(actor)!r}, "ref": {str(ref)!r}}}

            @property
            def rpcs(self):
                return critic_free_rpcs("grpo", reward="rule", n_samples=2, reward_impl="rule_reward",
                                        reward_args={{"rule": "token_set", "tokens": [5, 6]}})
        """))
    assert main(["show", str(exp)]) == 0
    out = capsys.readouterr().out
    [vocab] = [x for x in out.splitlines() if "vocabularies differ" in x]
    assert "(actor 512, ref 640 tokens)" in vocab and "ids below 500" in vocab
    [bos] = [x for x in out.splitlines() if "BOS" in x]
    assert bos.startswith(f"warning: tokenizer {actor} defines a BOS token ('<|bos|>', id {hf.bos_token_id})")
    # with the stock tokenizer (its post-processor adds BOS) and equal vocabularies: no warning
    exp.write_text(exp.read_text().replace(str(actor), str(hf_assets.checkpoint("llama", layers=2)))
                   .replace(str(ref), str(hf_assets.checkpoint("llama", layers=2))))
    assert main(["show", str(exp)]) == 0
    assert not re.search(r"BOS|vocabularies differ", capsys.readouterr().out)
