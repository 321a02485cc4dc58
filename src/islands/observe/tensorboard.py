"""TensorBoard: one event-file directory per process (rank), written with torch.utils.tensorboard.

    logger = TensorBoard("runs/mine/tb/rank0")       tensorboard --logdir runs/mine/tb

What lands where:
    scalars         every metric under its own name (train/loss, comm/sent_bytes/<kind>, ...), at its step.
                    TensorBoard keeps a scalar as float32: a read-back equals the logged value to ~1e-7
                    relative (a byte count above 2**24 is rounded to a multiple of a few bytes).
    text "params"   the run's parameters as a two-column table (TEXT tab), and the same values as
                    hyperparameters (HPARAMS tab), so runs can be told apart and filtered.
    text "events/<type>"   each membership change or checkpoint save, as its JSON, at its step.

Read back with TensorBoard's own reader:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator("runs/mine/tb/rank0", size_guidance={"scalars": 0, "tensors": 0}); ea.Reload()
    ea.Scalars("train/loss"); ea.Tensors("params/text_summary")[0].tensor_proto.string_val[0]
"""

from __future__ import annotations

import json
from pathlib import Path

from islands.observe.logger import needs


def params_table(params: dict) -> str:
    """The parameters as a Markdown table (TensorBoard renders its text summaries as Markdown)."""
    rows = ["| parameter | value |", "|---|---|"]
    for key in sorted(params):
        value = str(params[key]).replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {key} | {value} |")
    return "\n".join(rows)


def _hparam(value):
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class TensorBoard:
    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter  # heavy, optional: imported on first use
        except ImportError as e:  # torch raises ImportError when the tensorboard package is missing
            raise needs("tensorboard", "TensorBoard") from e
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer: SummaryWriter | None = SummaryWriter(log_dir=str(self.log_dir))

    def log_params(self, params: dict) -> None:
        if self.writer is None or not params:
            return
        from torch.utils.tensorboard.summary import hparams  # loaded with SummaryWriter

        self.writer.add_text("params", params_table(params), 0)
        file_writer = self.writer.file_writer
        assert file_writer is not None  # SummaryWriter opens it in __init__
        for summary in hparams({k: _hparam(v) for k, v in params.items()}, {}):
            file_writer.add_summary(summary)
        self.writer.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, float(value), int(step))

    def log_event(self, event: dict, step: int) -> None:
        if self.writer is None:
            return
        self.writer.add_text(f"events/{event.get('type', 'event')}", json.dumps(event, default=str), int(step))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
