"""`islands export RUN_DIR OUT`: a run's global model and tokenizer in the Hugging Face format.

    export(run_dir, out, step=None)   -> OUT, loadable by AutoModelForCausalLM / AutoTokenizer.from_pretrained
    global_model(run_dir, step=None)  -> (the model holding the checkpoint's global weights, tokenizer, step)

What is exported is the checkpoint's `model` entry, which the Trainer writes from `strategy.eval_model(model)`:
the global model. Under DiLoCo, streaming DiLoCo and every other outer strategy that is the outer model (the
last synchronised one), not any island's local weights; under fsdp the gathered full model. The model is rebuilt
from the run's RUN_DIR/hf_config.json, its weights loaded from rank 0's part of the newest intact checkpoint (or
`step`), strictly and after checking the run's fingerprint; the tokenizer is RUN_DIR/tokenizer.json.

Nothing is half-written: everything goes into a temporary sibling of OUT, is loaded back with transformers and
compared with the islands model (same logits on a sample), and only then renamed to OUT. OUT must not exist.
Only `hf-causal-lm` runs export: islands' own byte-level `lm` model is not a transformers architecture.
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
            f"{hf_lm.NAME} runs (a transformers model) only. Train with --task {hf_lm.NAME}"
        )
    return cfg


def checkpoint_root(cfg: JobConfig, run_dir: Path) -> Path:
    if not cfg.checkpoint.dir:
        return run_dir / "ckpt"
    root = Path(cfg.checkpoint.dir)
    return root if root.is_absolute() or root.is_dir() else run_dir / root


def global_model(run_dir: str | os.PathLike, step: int | None = None):
    """(model, tokenizer, step): the run's global model rebuilt from its hf_config.json and checkpoint."""
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
    if not root.is_dir():
        raise ExportError(
            f"run {str(run_dir)!r} has no checkpoint directory ({root}): train with "
            "--checkpoint.every N (the final step is then always saved)"
        )
    try:
        loaded = CheckpointStore(root, clean=False).load(step, rank=0, fingerprint=fingerprint(cfg))
    except (NoCheckpoint, CorruptCheckpoint, CheckpointMismatch) as e:
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
    # generation reads a KV cache; training switched it off. The ignore: build_model's nn.Module return makes
    # .config Tensor | Module (nn.Module.__getattr__); it is a transformers model's PretrainedConfig
    model.config.use_cache = True  # type: ignore[union-attr]
    return model.eval(), tok, loaded.step


def hf_tokenizer(tok):
    """The islands tokenizer as transformers' fast tokenizer, its one special token as BOS, EOS and padding."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tk.EOS, eos_token=tk.EOS, pad_token=tk.EOS)


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
    model, tok, at = global_model(run_dir, step)
    fast = hf_tokenizer(tok)
    eos = tk.eos_id(tok)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(model.config, key, None) is None:
            setattr(model.config, key, eos)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
            model.config.bos_token_id,
            model.config.eos_token_id,
            model.config.pad_token_id,
        )
        gen.use_cache = True
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(str(tmp))
        fast.save_pretrained(str(tmp))
        diff = _check_loads(tmp, model, tok) if verify else None
        os.rename(tmp, out)  # the directory appears whole, or not at all
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "out": str(out),
        "step": at,
        "model": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": tk.vocab_size(tok),
        "max_logit_difference": diff,
    }
