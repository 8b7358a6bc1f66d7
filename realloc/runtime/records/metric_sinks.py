"""Where per-iteration metrics go besides metrics.jsonl: TensorBoard and, optionally, Weights & Biases.

- TensorBoard (on by default): event files in ``RUN/tensorboard/``, the events torch's ``SummaryWriter`` writes,
  written with the ``tensorboard`` package's own writer (the master runs without torch: docs/speed.md);
  ``tensorboard --logdir RUN/tensorboard``.
- Weights & Biases (``--wandb PROJECT``): offline unless ``WANDB_MODE`` says otherwise or an API key
  is configured (``WANDB_API_KEY``), so a run on a cluster without network still keeps its log in
  ``RUN/wandb/``; ``wandb sync`` uploads it later.

Both get the run's configuration (the command's experiment, overrides and plan, and the fully resolved
experiment): W&B as the run's config, TensorBoard as text under ``config`` (the Text tab).

Every number of a metrics line is logged under its name at step = iteration (counted from 1):
headline PPO values under ``train/``, seconds per node under ``time/``, evaluation under ``eval/``.
``tokens`` (the same count every iteration) is left to metrics.jsonl. A resumed run (from the state after
iteration N) purges the TensorBoard steps after N that the killed run had written, so none is doubled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def write(self, scalars: dict[str, float], step: int) -> None: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


NOT_LOGGED = frozenset({"iteration", "tokens"})  # the step itself, and a constant of the run
CONFIG_TAG = "config"


def config_markdown(config: dict[str, Any]) -> str:
    """The run's config as TensorBoard text: markdown, so the JSON keeps its indentation (a code block)."""
    body = json.dumps(config, indent=2, default=str)
    return "\n".join("    " + line for line in body.splitlines())


def scalars_of(m: dict[str, Any]) -> dict[str, float]:
    """The loggable numbers of one metrics.jsonl line, by their TensorBoard tag."""
    out: dict[str, float] = {}
    for k, v in m.items():
        if k in NOT_LOGGED or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[f"train/{k}"] = float(v)
        elif k == "time" and isinstance(v, dict):
            out.update({f"time/{n}": float(t) for n, t in v.items()})
        elif k == "eval" and isinstance(v, dict):
            out.update({f"eval/{n}": float(x) for n, x in v.items() if isinstance(x, (int, float))})
    return out


class EventWriter:
    """The events torch's ``SummaryWriter`` writes for ``add_scalar`` and ``add_text`` (and a purge step), through
    the ``tensorboard`` package's event file writer: 0.16 CPU s to import instead of torch's 1.6."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event = Event
        self.writer = EventFileWriter(str(folder), 10, 120, "")  # SummaryWriter's queue size and flush period
        if purge_step is not None:  # readers drop the earlier files' events from this step on
            self._add(Event(step=purge_step, file_version="brain.Event:2"))
            self._add(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event: Any, step: int | None = None) -> None:
        event.wall_time = time.time()
        if step is not None:
            event.step = int(step)
        self.writer.add_event(event)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(self._event(summary=Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])), step)

    def add_text(self, tag: str, text: str, global_step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf_8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        value = Summary.Value(tag=tag + "/text_summary", metadata=meta, tensor=tensor)
        self._add(self._event(summary=Summary(value=[value])), global_step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TensorBoardSink:
    def __init__(self, folder: Path, first_step: int = 1, config: dict[str, Any] | None = None) -> None:
        self.folder = folder
        # A resumed run: readers drop the earlier files' events from first_step on (the killed run's
        # iterations after the checkpoint, which this run writes again).
        self.writer = EventWriter(folder, purge_step=first_step if first_step > 1 else None)
        if config:  # the run's settings, on TensorBoard's Text tab (a resumed run adds its own at its first step)
            self.writer.add_text(CONFIG_TAG, config_markdown(config), global_step=first_step)
            self.writer.flush()

    def describe(self) -> str:
        return f"tensorboard {self.folder}"

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a killed run keeps every finished iteration

    def close(self) -> None:
        self.writer.close()


WANDB_MISSING = "--wandb needs the wandb package: pip install 'realloc[wandb]'"


def check_wandb_installed() -> None:
    """One error when ``--wandb`` cannot work (also run before submitting a SLURM job: see run_cli)."""
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(WANDB_MISSING)


class WandbSink:
    def __init__(self, folder: Path, project: str, name: str, config: dict[str, Any]) -> None:
        check_wandb_installed()
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        folder.mkdir(parents=True, exist_ok=True)
        # Quiet (the console belongs to the run's own lines), and no code, git or system sampling.
        settings = wandb.Settings(silent=True, console="off", save_code=False, disable_git=True,
                                  x_disable_stats=True, disable_job_creation=True)
        self.run = wandb.init(project=project, name=name, dir=str(folder), mode=mode, config=config,
                              settings=settings)
        self.mode = mode
        self.project = project

    def describe(self) -> str:
        how = {"offline": " (`wandb sync` uploads it)", "online": ""}.get(self.mode, "")
        return f"wandb {self.mode} project {self.project}{how}"

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # stops wandb's service process, which writes the run file out before it exits


class MetricSinks:
    """All sinks of a run; ``write`` takes one metrics.jsonl line."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def open(cls, run_dir: Path, *, tensorboard: bool, wandb_project: str | None, run_name: str,
             config: dict[str, Any], first_iteration: int = 1) -> "MetricSinks":
        sinks: list[Sink] = []
        try:
            if tensorboard:
                sinks.append(TensorBoardSink(run_dir / "tensorboard", first_iteration, config))
            if wandb_project:
                sinks.append(WandbSink(run_dir, wandb_project, run_name, config))
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    def describe(self) -> str | None:
        """The run header's line: where metrics go besides metrics.jsonl (and wandb's mode)."""
        return f"metrics also to: {'; '.join(s.describe() for s in self.sinks)}" if self.sinks else None

    def write(self, m: dict[str, Any]) -> None:
        scalars = scalars_of(m)
        for s in self.sinks:
            s.write(scalars, int(m["iteration"]))

    def close(self) -> None:
        for s in self.sinks:
            s.close()
