"""`realloc show` calls each reward the user brings on the first dataset record, before anything runs: a reward
that raises, returns the wrong count, or a service that is not there is one line naming the call; a working one
prints its score, checked against the function (or service) applied to that record by hand."""

from __future__ import annotations

import json
import re
import socket
import textwrap
from pathlib import Path

import pytest

from realloc.cli import main
from reward_service import Service

RECORDS = [{"prompt": [5, 6, 7], "w": 2.5}, {"prompt": [1, 2], "w": 1.0}]


def _experiment(tmp_path: Path, reward_body: str, impl: str = "batch_reward", args: str = '{"fn": score}') -> Path:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    module = "score_" + re.sub(r"\W", "_", tmp_path.name)  # one module name per test: imports are cached
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(reward_body))
    exp = tmp_path / "exp.py"
    exp.write_text(textwrap.dedent(f"""\
        import dataclasses
        from {module} import score
        from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
        from realloc.api import auto

        @auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
        @dataclasses.dataclass
        class Exp:
            dataset: str = "prompts.jsonl"
            grpo: GRPOConfig = GRPOConfig()
            url: str = ""

            @property
            def rpcs(self):
                return critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=2, reward_impl={impl!r},
                                        reward_args={args})
        """))
    return exp


def _show(exp: Path, capsys, *sets: str) -> tuple[int, str, str]:
    rc = main(["show", str(exp), *[a for s in sets for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_prints_the_score_of_the_first_record(tmp_path, capsys):
    exp = _experiment(tmp_path, """\
        def score(prompts, responses, records):
            return [sum(p) + len(r) + rec["w"] for p, r, rec in zip(prompts, responses, records)]
        """)
    rc, out, err = _show(exp, capsys)
    assert rc == 0, err
    by_hand = sum(RECORDS[0]["prompt"]) + 0 + RECORDS[0]["w"]  # token ids (no tokenizer), empty response
    assert f"reward rew_inf: score(first record, empty response) = {by_hand:g}" in out


@pytest.mark.parametrize("body, words", [
    ("def score(prompts, responses, records):\n    return [rec['answr'] for rec in records]\n",
     ["KeyError", "'answr'", ".py, line 2", "return [rec['answr']"]),
    ("def score(prompts, responses, records):\n    return [1.0, 2.0]\n", ["returned [1.0, 2.0] for one sequence"]),
    ("def score(prompts, responses, records):\n    return [float('nan')]\n", ["one finite number"]),
])
def test_a_broken_reward_function_is_one_line_naming_the_call(tmp_path, capsys, body, words):
    rc, out, err = _show(_experiment(tmp_path, body), capsys)
    assert rc == 2 and out.count("\n") < 8  # stopped before the graph and the plan space were printed
    [line] = err.splitlines()
    assert line.startswith("realloc show: error: call 'rew_inf'") and all(w in line for w in words), line


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_a_reward_service_is_asked_for_the_first_record(tmp_path, capsys):
    exp = _experiment(tmp_path, "def score(*a):\n    return []\n", "remote_reward",
                      '{"url": self.url, "retries": 3, "backoff": 0.01}')
    with Service(score=lambda r, rec: 7.0 + len(r) * 10 + rec["w"]) as svc:
        rc, out, err = _show(exp, capsys, f"url={svc.url}")
        assert rc == 0, err
        assert f"reward rew_inf: reward service {svc.url}(first record, empty response) = 9.5" in out
        assert svc.requests == 1
    url = f"http://127.0.0.1:{_dead_port()}/score"
    rc, out, err = _show(exp, capsys, f"url={url}")
    [line] = err.splitlines()
    assert rc == 2 and "call 'rew_inf'" in line and url in line and "cannot connect" in line
    assert "failed 2 time(s)" in line  # at most one retry in show, whatever the run's retries
