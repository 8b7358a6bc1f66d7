"""Evaluation passes during a run (``inputs/evaluation.py``): the actor generates on the eval batches in
its train step's layout, and the reward call scores them (a multi-turn generation scores its own, the
environment in the loop); or, without generation (a reward model), the train
step's scoring namesake scores the eval records in the train step's layout.

``EvaluationPasses`` is one part of ``Master`` (``master.py``), which creates the state these methods share.
"""

from __future__ import annotations

from realloc.graph.transfer_plan import DataLayout, plan_data_transfer
from realloc.runtime.control.master_schedule import Node
from realloc.runtime.inputs.evaluation import eval_key
from realloc.runtime.transfer.row_layout import row_bytes
from realloc.runtime.wire import protocol


class EvaluationPasses:
    """Which iterations evaluate, and one pass (a part of ``Master``)."""

    def _evaluates(self, t: int) -> bool:
        return self.eval_calls is not None and self.config.eval.due(t)

    async def _eval(self, n: Node) -> None:
        """An evaluation pass (``evaluation.py``): generate on the eval batches at the actor's home, then
        move the sequences to the reward call and score them.

        Every batch's request goes out at once and the replies are taken in batch order: the workers run the
        batches back to back instead of waiting for the master between them, and the reward of a batch can run
        while the master still takes the others' replies. Each batch is a request of its own with its own seed,
        and the sums add up in batch order, so the results are those of one batch after another."""
        ec, t, prog = self.eval_calls, n.t, self.program
        if ec.scorer:
            await self._eval_scores(n)
            return
        seq_key = self.graph.call(ec.generate).output_data[0]
        batches = range(self.config.eval.batches)
        if n.name == "generate":
            recs = [self._send(prog.calls[ec.train].ranks, "eval", f"eval generate {j}", t, n.label,
                               lambda req, j=j: protocol.RunCall(req=req, call=ec.generate, iteration=t,
                                                                 eval_batch=j, layout_call=ec.train))
                    for j in batches]
            stats = self.eval_stats.setdefault(t, {})
            for rec in recs:
                for rep in await self._wait(rec):
                    for out in rep.outputs:
                        self.data_meta.setdefault((out.key, t), out.tensors)
                    if ec.self_scored:  # a multi-turn rollout: the generation's own scores (the environment's)
                        for k, v in rep.stats.items():
                            stats[k] = stats.get(k, 0.0) + v
            return
        if ec.self_scored:  # scored already: nothing to move or score
            self._drop_eval_data(t)
            return
        sent = []
        for j in batches:
            key = eval_key(j, seq_key)
            metas = self.data_meta.pop((key, t))
            home = prog.calls[ec.train]
            plan = plan_data_transfer({key: [row_bytes(metas)] * prog.batch_size},
                                      DataLayout(home.mesh, home.strategy, tuple(range(home.strategy.pp))),
                                      prog.consumer(ec.reward))
            moves = self._send_transfer(key, ec.reward, t, plan, metas)
            sent.append((moves, self._send(prog.calls[ec.reward].ranks, "eval", f"eval reward {j}", t, n.label,
                                           lambda req, j=j: protocol.RunCall(req=req, call=ec.reward, iteration=t,
                                                                             eval_batch=j))))
        stats = self.eval_stats.setdefault(t, {})
        for moves, rec in sent:
            for m in moves:
                await self._wait(m)
            for rep in await self._wait(rec):
                for k, v in rep.stats.items():
                    stats[k] = stats.get(k, 0.0) + v
        self._drop_eval_data(t)

    def _drop_eval_data(self, t: int) -> None:
        """Forget the eval generation's outputs that nothing reads (logp; a self-scored one's all)."""
        for k in [k for k in self.data_meta if k[1] == t and k[0].startswith("eval")]:
            self.data_meta.pop(k)

    async def _eval_scores(self, n: Node) -> None:
        """An evaluation without generation: the train step's interface's INFERENCE namesake scores the eval
        batches in the train step's layout (its "generate" node; the "reward" node has nothing left to do).
        Every batch's request goes out at once; the sums add up in batch order (as ``_eval``)."""
        ec, t = self.eval_calls, n.t
        if n.name != "generate":
            return
        stats = self.eval_stats.setdefault(t, {})
        recs = [self._send(self.program.calls[ec.train].ranks, "eval", f"eval score {j}", t, n.label,
                           lambda req, j=j: protocol.RunCall(req=req, call=ec.train, iteration=t, eval_batch=j))
                for j in range(self.config.eval.batches)]
        for rec in recs:
            for rep in await self._wait(rec):
                for k, v in rep.stats.items():
                    stats[k] = stats.get(k, 0.0) + v
