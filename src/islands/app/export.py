"""`islands export RUN_DIR OUT`: a run's global model and tokenizer in the Hugging Face format.

    export(run_dir, out, step=None)   -> OUT, loadable by AutoModelForCausalLM / AutoTokenizer.from_pretrained
    global_model(run_dir, step=None)  -> (the model holding the run's global weights, tokenizer, step)

What is exported is the global model: under DiLoCo, streaming DiLoCo and every other outer strategy the outer
model (the last synchronised one), not any island's local weights; under fsdp the gathered full model. It comes
from one of two places, both written from `strategy.eval_model(model)`:

- a checkpoint, when the run has any (`--checkpoint.every N`): rank 0's part of the newest intact one, or `step`,
  loaded strictly into the model rebuilt from RUN_DIR/hf_config.json after checking the run's fingerprint (what
  export always did; the run's last step is always checkpointed, so this is the final model too);
- else RUN_DIR/model, the model every run writes when it ends (islands.loop.callbacks.SaveModel; `step` cannot
  choose another there). A run that failed or was stopped before its end has neither.

The tokenizer is RUN_DIR/tokenizer.json. Nothing is half-written: everything goes into a temporary sibling of OUT,
is loaded back with transformers and compared with the islands model (same logits on a sample), and only then
renamed to OUT. OUT must not exist. Only `hf-causal-lm` runs export: islands' own byte-level `lm` model is not a
transformers architecture (its final weights are RUN_DIR/model/model.safetensors).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from islands.app.build import fingerprint
from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.store.directory import CheckpointStore
from islands.checkpoint.store.model_dir import MODEL_DIR, read_info
from islands.config import ConfigError, JobConfig, from_mapping, load_json
from islands.data import tokenizer as tk
from islands.tasks import hf_lm

ATOL = 1e-5  # the exported model's logits equal the islands model's within fp32 tolerance


class ExportError(ValueError):
    """A run that cannot be exported; the message says why and what would work (the CLI exits 2)."""


def run_config(run_dir: Path) -> JobConfig:
    """The job config of a run: its config.json (the launcher writes it), else the one its run.json records (a
    single-worker or torchrun job, which has no launcher)."""
    path, record = run_dir / "config.json", run_dir / "run.json"
    if not path.is_file() and not record.is_file():
        raise ExportError(
            f"{str(run_dir)!r} is not a run directory: it has neither config.json nor run.json "
            "(give the directory `islands train` wrote, e.g. runs/<time>-hf-causal-lm-w2)"
        )
    try:
        cfg = load_json(path) if path.is_file() else from_mapping(json.loads(record.read_text())["config"])
    except (ConfigError, ValueError, KeyError) as e:
        raise ExportError(f"{path if path.is_file() else record}: not an islands job config: {e}") from None
    if cfg.task.name != hf_lm.NAME:
        raise ExportError(
            f"run {str(run_dir)!r} trained task {cfg.task.name!r}; `islands export` writes "
            f"{hf_lm.NAME} runs (a transformers model) only. Train with --task {hf_lm.NAME} "
            f"(this run's final weights are {run_dir / MODEL_DIR / 'model.safetensors'}, when it finished)"
        )
    return cfg


def checkpoint_root(cfg: JobConfig, run_dir: Path) -> Path:
    if not cfg.checkpoint.dir:
        return run_dir / "ckpt"
    root = Path(cfg.checkpoint.dir)
    return root if root.is_absolute() or root.is_dir() else run_dir / root


def global_model(run_dir: str | os.PathLike, step: int | None = None):
    """(model, tokenizer, step): the run's global model, from its checkpoint or the model it ended with (module
    docstring)."""
    model, tok, step, _ = load_global(run_dir, step)
    return model, tok, step


def load_global(run_dir: str | os.PathLike, step: int | None = None):
    """global_model's (model, tokenizer, step) and where the model came from: "checkpoint" or "model" (RUN/model)."""
    from transformers import AutoConfig

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    for name in (hf_lm.HF_CONFIG_FILE, hf_lm.TOKENIZER_FILE):
        if not (run_dir / name).is_file():
            raise ExportError(
                f"run {str(run_dir)!r} has no {name} (rank 0 writes it when the task is built); "
                "was the run started by an older islands?"
            )
    data = json.loads((run_dir / hf_lm.HF_CONFIG_FILE).read_text())
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    tok = tk.load(run_dir / hf_lm.TOKENIZER_FILE)
    problem = tk.check_fits(tok, hf_lm.embedding_rows(config), where=f"{run_dir / hf_lm.TOKENIZER_FILE}")
    if problem:
        raise ExportError(problem)
    root = checkpoint_root(cfg, run_dir)
    loaded = _from_checkpoint(run_dir, root, step, config, cfg)
    source = "checkpoint" if loaded is not None else "model"
    model, step = loaded if loaded is not None else _from_saved(run_dir / MODEL_DIR, root)
    model.config.use_cache = True  # generation reads a KV cache; training switched it off
    return model.eval(), tok, step, source


def _from_checkpoint(run_dir: Path, root: Path, step: int | None, config, cfg: JobConfig):
    """(model, step) from the run's checkpoints; None when it has none and no `step` asks for one."""
    if not root.is_dir():
        if step is None:
            return None
        raise ExportError(
            f"run {str(run_dir)!r} has no checkpoint directory ({root}): --step exports a checkpoint (train with "
            f"--checkpoint.every N); without --step, export writes the model the run ended with ({MODEL_DIR}/)"
        )
    try:
        loaded = CheckpointStore(root, clean=False).load(step, rank=0, fingerprint=fingerprint(cfg))
    except NoCheckpoint as e:
        if step is None:
            return None
        raise ExportError(f"run {str(run_dir)!r}: {e}") from None
    except (CorruptCheckpoint, CheckpointMismatch) as e:
        raise ExportError(f"run {str(run_dir)!r}: {e}") from None
    model = hf_lm.build_model(config, seed=cfg.train.seed)
    assert isinstance(loaded.tree, dict)  # a run's checkpoint: the driver's tree (CheckpointDriver.tree)
    state = loaded.tree["model"]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ExportError(
            f"run {str(run_dir)!r}: checkpoint step {loaded.step} does not fit the model of {hf_lm.HF_CONFIG_FILE}: {e}"
        ) from None
    return model, loaded.step


def _from_saved(saved: Path, root: Path):
    """(model, step) from RUN_DIR/model, the model the run ended with."""
    from transformers import AutoModelForCausalLM

    info = read_info(saved) if saved.is_dir() else None
    if info is None:
        raise ExportError(
            f"run {str(saved.parent)!r} has neither the model it ends with ({saved}: rank 0 writes it when the run "
            f"finishes; did it fail or was it killed? its logs say) nor a checkpoint ({root}; train with "
            "--checkpoint.every N to keep models along the way)"
        )
    if info.get("format") != "transformers":
        raise ExportError(f"{saved} holds a {info.get('format')!r} model, not a transformers one")
    model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    return model, int(info["step"])


def sample_ids(tok, model, length: int = 16) -> torch.Tensor:
    ids = tok.encode("def main():\n    return 0\n" * 4, add_special_tokens=False).ids[:length]
    limit = hf_lm.max_positions(model.config) or length
    return torch.tensor([ids[: min(length, limit)] or [0]])


def _check_loads(tmp: Path, model, tok) -> float:
    """Load `tmp` as a user would and compare logits with `model`; the largest difference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    back = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(str(tmp))
    x = sample_ids(tok, model)
    with torch.no_grad():
        diff = (back(x).logits - model(x).logits).abs().max().item()
    if not diff <= ATOL:
        raise ExportError(
            f"the exported model's logits differ from the islands model's by {diff:.3g} (> {ATOL}); nothing was written"
        )
    return diff


def export(run_dir: str | os.PathLike, out: str | os.PathLike, step: int | None = None, verify: bool = True) -> dict:
    """Write the run's global model and tokenizer to `out` (module docstring); a summary of what was written."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a command's output, not a terminal's progress bars
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        raise ExportError(f"{str(out)!r} exists; export writes a new directory (remove it or choose another path)")
    model, tok, at, source = load_global(run_dir, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        hf_lm.save_pretrained(model, tok, tmp)
        diff = _check_loads(tmp, model, tok) if verify else None
        os.rename(tmp, out)  # the directory appears whole, or not at all
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "out": str(out),
        "step": at,
        "source": source,
        "model": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": tk.vocab_size(tok),
        "max_logit_difference": diff,
    }
