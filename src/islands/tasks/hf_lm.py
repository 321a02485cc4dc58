"""`transformers` causal language models as an islands Task: `islands train --task hf-causal-lm`, or from Python
`islands.tasks.hf_causal_lm(...)`.

The model is either a family built from its config class with random initialisation (`gpt2`, `llama`, `qwen2`, or
any other causal-LM `model_type` transformers knows), shaped by the task's `d_model`, `n_layers`, `n_heads`,
`context` and vocabulary, or a local directory (`from_pretrained`: its config.json, and its weights when it has
them). `model_overrides` ("n_layer=2,n_embd=64", the spec grammar's key=value list) sets any key of the config;
a key the config class does not have is an error, not a silently ignored typo. Nothing is downloaded.

The tokenizer (islands.data.tokenizer): `bpe` trains a byte-level BPE of `vocab_size` tokens on the training
text; `byte` uses the bytes themselves (257 ids with end-of-text); a path reads a tokenizer.json; `auto` is the
model directory's own tokenizer.json if it has one, else `bpe`. Every rank trains its own BPE: training is
deterministic, so the copies are equal and no rank waits for another (an elastic joiner, which starts later,
gets the same one too). Rank 0 saves it as RUN_DIR/tokenizer.json, beside RUN_DIR/hf_config.json (the model's
resolved config), which is what `islands export` reads. A resumed run never retrains: it loads the
tokenizer.json of the run it resumes (found in the resume path or the run directory above it) and saves a copy
in its own run directory.

Data: the byte corpus of the built-in `lm` task (a text file or directory; "" = the Python standard library's
source), split the same way, each rank tokenising its own shard of the training text when its loader is made
(islands.data.tokenized); or JSON lines, Parquet or a glob of text files read through `datasets`
(islands.data.documents, `text_column` naming the text), streamed, tokenised once into a cache shared by every
rank and later run, and read as memory-mapped windows sharded per rank (islands.data.token_cache). Either way the
loader's position is checkpointed, so a resumed run reads exactly the next batch. Batches are (ids, next ids) and
the loss is cross-entropy on the model's logits, exactly as transformers' own shifted-label loss computes it.

Precision and memory (issue #18): the task's precision is "auto", bf16 autocast on a CUDA device and plain fp32
on the CPU (islands.memory.step.resolve_precision; `--precision auto` on the command line, or
`ForwardBackward(precision=task.precision)` from Python), the parameters and optimizer state fp32 either way.
`activation_checkpointing` switches on the model's own gradient checkpointing, non-reentrant
(islands.memory.recompute.enable_activation_checkpointing). Attention is torch's scaled_dot_product_attention
(ATTENTION, "sdpa": fused kernels on a GPU) where the architecture has it, else transformers' own choice; the run
record's data line says which.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from islands.data import TextCorpus, load_text, tokenizer as tk
from islands.data.documents import DocumentSource, is_document_source
from islands.data.loader import fixed_val_batches_lm
from islands.data.token_cache import ArrayWindows, fixed_val_windows, tokenise_once
from islands.data.tokenized import text_shard, token_windows
from islands.loop.task import Task
from islands.models import sequence_loss
from islands.runtime import simulate
from islands.spec import POSITIONAL, SpecError, parse
from islands.tasks.builtin import Sharded
from islands.tasks.user import TaskError

NAME = "hf-causal-lm"
FAMILIES = ("gpt2", "llama", "qwen2")  # tested; any causal-LM model_type of transformers builds the same way
TOKENIZERS = ("auto", "bpe", "byte")  # or a path to a tokenizer.json / a directory holding one
TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "hf_config.json"  # the model's resolved transformers config, in the run directory
BPE_SAMPLE_CHARS = 100_000_000  # a BPE trained on documents learns from at most this much of their text
PRECISION = "auto"  # SOTA-118: bf16 matmuls with fp32 master weights on a GPU; fp32 on a CPU (no bf16 units to gain)
# torch's scaled_dot_product_attention: fused attention kernels on a GPU (issue #34 item 2). transformers picks it by
# default today; asked for by name so that it cannot change unseen, and the pipeline's pieces need it (hf_pieces)
ATTENTION = "sdpa"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class HFTask(Task):
    """An islands Task that also carries its tokenizer (a `tokenizers.Tokenizer`) and the model's config."""

    tokenizer: Any = None
    hf_config: Any = None
    precision: str = "auto"  # bf16 autocast on CUDA, fp32 on the CPU (PRECISION)


# ---- the model's config -------------------------------------------------------------------------------
def parse_overrides(text: str | dict | None) -> dict:
    """ "n_layer=2,n_embd=64" (the spec grammar's key=value list; quote text with grammar characters) -> a dict."""
    if not text:
        return {}
    if isinstance(text, dict):
        return dict(text)
    try:
        spec = parse(f"overrides:{text}")
    except SpecError as e:
        raise TaskError(
            f"task.model_overrides={text!r} is not a key=value list such as 'n_layer=2,n_embd=64': {e}"
        ) from None
    args = dict(spec.args)
    if POSITIONAL in args:
        raise TaskError(f"task.model_overrides={text!r}: every entry needs a key, e.g. 'n_layer=2,n_embd=64'")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()}


def is_local(model: str) -> bool:
    """A path (to a directory or a config.json), not a family name."""
    return os.sep in model or "/" in model or model.startswith(".") or model.endswith(".json") or Path(model).exists()


def _check_keys(default, overrides: dict, where: str) -> None:
    """Every override names a key the config class has (a typo is an error, not an ignored attribute)."""
    for key in overrides:
        if not hasattr(default, key):
            known = [k for k in default.to_dict() if not k.startswith("_")]
            known += list(getattr(type(default), "attribute_map", {}))
            near = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise TaskError(
                f"task.model_overrides: {where}'s config ({type(default).__name__}) has no key {key!r}{hint}"
            )


def _apply(config, overrides: dict, where: str):
    _check_keys(type(config)(), overrides, where)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _causal_lm_types() -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def family_config(
    family: str,
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    context: int,
    vocab: int,
    eos: int | None,
    overrides: dict,
):
    """A fresh config of `family` (a transformers model_type) shaped small by the task's keys, then `overrides`."""
    from transformers import CONFIG_MAPPING

    if family not in _causal_lm_types() or family not in CONFIG_MAPPING:
        near = difflib.get_close_matches(family, list(_causal_lm_types()), n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise TaskError(
            f"task.model={family!r} is neither a causal-LM family transformers knows (e.g. "
            f"{', '.join(FAMILIES)}) nor a local directory{hint}"
        )
    cls = CONFIG_MAPPING[family]
    default = cls()
    shape = {
        "hidden_size": d_model,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "max_position_embeddings": context,
        "vocab_size": vocab,
    }
    if getattr(default, "intermediate_size", None) is not None:
        shape["intermediate_size"] = 4 * d_model  # the families' defaults are billions-of-parameters sized
    if hasattr(default, "num_key_value_heads"):
        shape["num_key_value_heads"] = n_heads
    if eos is not None:
        shape.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    _check_keys(default, overrides, family)
    kwargs: dict[str, Any] = {_own_name(cls, k): v for k, v in shape.items()}
    kwargs.update({_own_name(cls, k): v for k, v in overrides.items()})  # before construction: derived keys follow
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise TaskError(f"task.model={family!r}: its config refused {kwargs}: {e}") from None


def _own_name(cls, key: str) -> str:
    """`hidden_size` -> `n_embd` for GPT-2 (its attribute_map maps the common names to its own)."""
    return getattr(cls, "attribute_map", {}).get(key, key)


def local_config(path: str, overrides: dict):
    """The config of a local model directory (or a config.json file), then `overrides`."""
    from transformers import AutoConfig

    p = Path(path)
    file = p if p.is_file() else p / "config.json"
    if not p.exists():
        raise TaskError(
            f"task.model={path!r}: no such directory; give a family ({', '.join(FAMILIES)}) or a "
            "local directory holding a transformers config.json"
        )
    if not file.is_file():
        raise TaskError(
            f"task.model={path!r}: the directory has no config.json, so there is no model to build; "
            "give a directory written by save_pretrained (or `islands export`), or a family name"
        )
    try:
        config = AutoConfig.from_pretrained(str(file.parent)) if file.name == "config.json" else None
        if config is None:
            data = json.loads(file.read_text())
            config = AutoConfig.for_model(data.pop("model_type"), **data)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for a config it cannot read
        raise TaskError(f"task.model={path!r}: {file} is not a transformers config: {type(e).__name__}: {e}") from None
    if type(config).model_type not in _causal_lm_types():
        raise TaskError(
            f"task.model={path!r}: model_type {type(config).model_type!r} is not a causal language "
            "model transformers can build (AutoModelForCausalLM)"
        )
    return _apply(config, overrides, path)


def embedding_rows(config) -> int:
    rows = getattr(config, "vocab_size", None)
    if rows is None and hasattr(config, "get_text_config"):
        rows = getattr(config.get_text_config(), "vocab_size", None)
    if rows is None:
        raise TaskError(f"the model's config ({type(config).__name__}) has no vocab_size")
    return int(rows)


def max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def has_weights(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in WEIGHT_FILES)


def _build(config, pretrained: str | None, seed: int, attention: str | None) -> Any:
    """A transformers PreTrainedModel (its `config` is read and set after)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if pretrained and has_weights(pretrained):
        return AutoModelForCausalLM.from_pretrained(
            pretrained, config=config, dtype=torch.float32, attn_implementation=attention
        )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)


def build_model(config, pretrained: str | None = None, seed: int = 0) -> torch.nn.Module:
    """A causal LM from `config`: weights from `pretrained` (a local directory) when it has them, else random
    initialisation after torch.manual_seed(seed) (the same on every rank). Parameters in fp32. Attention is
    ATTENTION where the architecture has it, else transformers' own choice; `attention_of(model)` says which."""
    try:
        model = _build(config, pretrained, seed, ATTENTION)
    except ValueError:  # transformers refuses an implementation the architecture lacks; the seed is set again
        model = _build(config, pretrained, seed, None)
    model.config.use_cache = False  # training never reads a KV cache; export turns it back on
    return model


def attention_of(model: torch.nn.Module) -> str:
    """The attention implementation transformers chose for `model` ("sdpa", "eager", ...)."""
    return str(getattr(model.config, "_attn_implementation", None) or "unknown")


# ---- the tokenizer ------------------------------------------------------------------------------------
def resumed_tokenizer(resume: str) -> Path | None:
    """The tokenizer.json of the run `resume` names (a run directory, its checkpoint directory or a step
    directory): looked for there and in the two directories above."""
    p = Path(resume)
    for d in (p, p.parent, p.parent.parent):
        if (d / TOKENIZER_FILE).is_file():
            return d / TOKENIZER_FILE
    return None


def tokenizer_source(tokenizer: str, model: str, resume: str = "") -> tuple[str, Path | None]:
    """(kind, path) without building anything: kind "bpe" | "byte" | "file"; a path to read, or None. A resumed
    BPE run reads its run's tokenizer.json (kind stays "bpe": the model's vocabulary is still vocab_size)."""
    if tokenizer not in TOKENIZERS:
        return "file", Path(tokenizer)
    if tokenizer == "byte":
        return "byte", None
    if tokenizer == "auto" and is_local(model) and (Path(model) / TOKENIZER_FILE).is_file():
        return "file", Path(model) / TOKENIZER_FILE
    if resume:
        found = resumed_tokenizer(resume)
        if found is None:
            raise TaskError(
                f"resuming from {resume!r}, whose run has no {TOKENIZER_FILE} (looked in it and the two "
                f"directories above): the tokenizer is not retrained on resume; give task.tokenizer="
                "PATH/tokenizer.json of the run"
            )
        return "bpe", found
    return "bpe", None


def model_vocab(kind: str, tok, vocab_size: int) -> int:
    """The embedding rows of a model built fresh for this tokenizer: vocab_size for a BPE (trained to at most
    that), 257 for bytes, the file's own size for a given tokenizer."""
    if kind == "bpe":
        return vocab_size
    return tk.vocab_size(tok)


def _text(data: np.ndarray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


def _encode(kind: str, tok, data: np.ndarray | bytes) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    if kind == "byte":  # the byte tokenizer's ids are the bytes: no need to run it
        return raw.astype(np.int32)
    return tk.encode(tok, _text(raw))


def _is_rank0() -> bool:
    island = simulate.current_island()  # islands simulated in one process share torch.distributed's state
    if island is not None:
        return island == 0
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_run_files(run_dir: str | os.PathLike, tok, config) -> None:
    """RUN_DIR/tokenizer.json and RUN_DIR/hf_config.json, each written whole or not at all."""
    run_dir = Path(run_dir)
    tk.save(tok, run_dir / TOKENIZER_FILE)
    tmp = run_dir / f".{HF_CONFIG_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(config.to_json_string())
        os.replace(tmp, run_dir / HF_CONFIG_FILE)
    finally:
        tmp.unlink(missing_ok=True)


# ---- the saved model -----------------------------------------------------------------------------------
def hf_tokenizer(tok):
    """The islands tokenizer as transformers' fast tokenizer, its one special token as BOS, EOS and padding."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tk.EOS, eos_token=tk.EOS, pad_token=tk.EOS)


def save_pretrained(model: Any, tok, directory: str | os.PathLike) -> None:
    """`model` and `tok` as transformers loads them (AutoModelForCausalLM / AutoTokenizer.from_pretrained):
    config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json. The config
    says what generation needs: the KV cache on (training switched it off), end-of-text as BOS, EOS and padding
    where the model's config named none or an id outside its vocabulary (a user's config of another tokenizer).
    The model's own config is put back as it was afterwards: a model still training is not changed. `model`: a
    transformers PreTrainedModel (typed Any: transformers is an optional import)."""
    config = model.config
    gen = getattr(model, "generation_config", None)
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    kept = {k: getattr(config, k, None) for k in (*keys, "use_cache")}
    kept_gen = {k: getattr(gen, k, None) for k in (*keys, "use_cache")} if gen is not None else {}
    eos, rows = tk.eos_id(tok), embedding_rows(config)
    try:
        for key in keys:
            value = getattr(config, key, None)
            if not isinstance(value, int) or not 0 <= value < rows:
                setattr(config, key, eos)
        config.use_cache = True
        if gen is not None:
            for key in keys:
                setattr(gen, key, getattr(config, key))
            gen.use_cache = True
        with _no_progress_bars():  # a file being written, not a terminal's bar in the run's output
            model.save_pretrained(str(directory))
            hf_tokenizer(tok).save_pretrained(str(directory))
    finally:
        for key, value in kept.items():
            setattr(config, key, value)
        for key, value in kept_gen.items():
            setattr(gen, key, value)


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def is_pretrained(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers model itself (save_pretrained writes it), not a module wrapping one."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


class PretrainedWriter:
    """A transformers model's final save (islands.checkpoint.store.model_dir.ModelWriter): save_pretrained's files
    with the run's tokenizer, so RUN_DIR/model loads with from_pretrained as it is."""

    format = "transformers"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def write(self, model: torch.nn.Module, directory: Path) -> None:
        save_pretrained(model, self.tokenizer, directory)


# ---- the task -----------------------------------------------------------------------------------------
def resolve(
    model: str = "gpt2",
    model_overrides: str | dict = "",
    tokenizer: str = "auto",
    vocab_size: int = 512,
    texts: Callable[[], Iterable[str]] | None = None,
    context: int = 128,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    resume: str = "",
    train: bool = True,
):
    """(tokenizer kind, tokenizer, config, how the tokenizer was obtained) for these options; `texts()` gives the
    training text a BPE learns from. `train=False` skips training a BPE (validation: the tokenizer is then None and
    the model's vocabulary is vocab_size)."""
    overrides = parse_overrides(model_overrides)
    kind, path = tokenizer_source(tokenizer, model, resume)
    if kind == "bpe" and vocab_size < tk.MIN_BPE_VOCAB:  # before any training: validation reports it too
        raise TaskError(
            f"task.vocab_size={vocab_size} is too small for a byte-level BPE: it holds the 256 byte "
            f"symbols and the end-of-text token; use vocab_size >= {tk.MIN_BPE_VOCAB}"
        )
    if path is not None:
        tok, how = tk.load(path), f"loaded {path}"
    elif kind == "byte":
        tok, how = tk.byte_tokenizer(), "bytes"
    elif train:
        if texts is None:
            raise TypeError("resolve: training a BPE (train=True) needs texts")
        tok = tk.train_bpe(texts(), vocab_size)
        how = f"byte-level BPE trained here ({tk.vocab_size(tok)} tokens)"
    else:
        tok, how = None, "byte-level BPE (trained at the start of the run)"
    eos = tk.eos_id(tok) if tok is not None else 0
    rows = model_vocab(kind, tok, vocab_size) if tok is not None else vocab_size
    if is_local(model):
        config = local_config(model, overrides)
    else:
        config = family_config(
            model,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            context=context,
            vocab=rows,
            eos=eos,
            overrides=overrides,
        )
    limit = max_positions(config)
    if limit is not None and context > limit:
        raise TaskError(f"task.context={context} exceeds the model's {limit} positions; use context <= {limit}")
    if tok is not None:
        problem = tk.check_fits(tok, embedding_rows(config), where=f"the tokenizer ({how})")
        if problem:
            raise TaskError(problem)
    return kind, tok, config, how


class _Corpus:
    """The training data either way: islands' byte corpus (a text file or directory, "" = the standard library's
    source; each rank tokenises its own shard) or documents through `datasets` (JSON lines, Parquet, text files;
    tokenised once into the cache, islands.data.token_cache)."""

    def __init__(self, data: str, text_column: str):
        self.documents = DocumentSource(data, text_column) if data and is_document_source(data) else None
        self.bytes = None if self.documents is not None else load_text(data)

    def _bytes(self) -> TextCorpus:
        assert self.bytes is not None  # set exactly when there are no documents
        return self.bytes

    def problem(self) -> str | None:
        if self.documents is not None:
            return self.documents.check()
        if len(self._bytes().train) == 0:
            return (
                f"the corpus {self._bytes().source!r} holds no text to train on; give a non-empty text file or "
                "directory (task.data)"
            )
        return None

    def texts(self) -> Iterator[str]:
        """The training text a BPE learns from (documents: the first BPE_SAMPLE_CHARS characters)."""
        if self.documents is None:
            yield _text(self._bytes().train)
            return
        seen = 0
        for text in self.documents.documents("train"):
            yield text
            seen += len(text)
            if seen >= BPE_SAMPLE_CHARS:
                return

    def describe(self) -> str:
        if self.documents is not None:
            return self.documents.describe()
        return f"{self._bytes().source} ({self._bytes().files} files)"


def _encoder(kind: str, tok) -> Callable[[list[str]], list[list[int]]]:
    if kind == "byte":
        return lambda texts: [list(t.encode()) for t in texts]
    return lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def hf_causal_lm(
    model: str = "gpt2",
    model_overrides: str | dict = "",
    tokenizer: str = "auto",
    vocab_size: int = 512,
    data: str = "",
    context: int = 128,
    batch_size: int = 8,
    eval_batches: int = 8,
    seed: int = 0,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    run_dir: str | os.PathLike | None = None,
    resume: str = "",
    text_column: str = "text",
) -> HFTask:
    """A transformers causal LM on a text corpus as an islands Task (module docstring). `data`: a text file or
    directory ("" = the standard library's source), or JSON lines / Parquet / a glob of files read through
    `datasets` (`text_column` names the text). `run_dir`: where rank 0 saves tokenizer.json and hf_config.json
    (None: nowhere; `task.tokenizer.save(path)` is yours to call). `resume`: the run (or checkpoint) being resumed,
    whose tokenizer is loaded instead of trained."""
    corpus = _Corpus(data, text_column)
    problem = corpus.problem()
    if problem:
        raise TaskError(problem)
    kind, tok, config, how = resolve(
        model, model_overrides, tokenizer, vocab_size, corpus.texts, context, d_model, n_layers, n_heads, resume
    )
    net = build_model(config, model if is_local(model) else None, seed)
    if run_dir is not None and _is_rank0():
        save_run_files(run_dir, tok, config)
    if corpus.documents is not None:
        key = f"{corpus.documents.identity()}-{tk.digest(tok)}"
        cached = tokenise_once(corpus.documents.documents, _encoder(kind, tok), tk.eos_id(tok), tk.vocab_size(tok), key)
        if cached.meta["train"]["tokens"] == 0:
            raise TaskError(f"the corpus {corpus.describe()!r} holds no text to train on (its documents are empty)")
        val = fixed_val_windows(cached.val, context, batch_size, eval_batches)
        train = Sharded(lambda shard, shards: ArrayWindows(cached.train, context, batch_size, shard, shards, seed))
    else:
        data_bytes = corpus._bytes()
        val = fixed_val_batches_lm(_encode(kind, tok, data_bytes.val), context, batch_size, eval_batches)
        train = Sharded(
            lambda shard, shards: token_windows(
                _encode(kind, tok, text_shard(data_bytes.train, shard, shards)), context, batch_size, shard, seed
            )
        )
    return HFTask(
        net,
        sequence_loss,
        train,
        val,
        batch_size=batch_size,
        tokens_per_sample=context,
        classes=embedding_rows(config),
        name=NAME,
        data_source=f"{corpus.describe()}; tokenizer: {how}; attention: {attention_of(net)}",
        tokenizer=tok,
        hf_config=config,
        precision=PRECISION,
    )


def check(
    model: str = "gpt2",
    model_overrides: str = "",
    tokenizer: str = "auto",
    vocab_size: int = 512,
    data: str = "",
    context: int = 128,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    resume: str = "",
    text_column: str = "text",
) -> str | None:
    """What `islands train` checks before any worker starts (no BPE is trained, no weights are read, documents are
    not tokenised): the model resolves (a directory has a config.json, a family and every override key exist), the
    context fits its positions, a tokenizer file (given, the model directory's or the resumed run's) fits its
    embedding, and the corpus has text (documents: the files exist and have the text column). A message, or None."""
    try:
        if data and not is_document_source(data) and not Path(data).exists():
            return None  # the `data` rule says so
        corpus = _Corpus(data, text_column)
        problem = corpus.problem()
        if problem:
            return problem
        resolve(
            model,
            model_overrides,
            tokenizer,
            vocab_size,
            corpus.texts,
            context,
            d_model,
            n_layers,
            n_heads,
            resume,
            train=False,
        )
    except (TaskError, tk.TokenizerError) as e:
        return str(e)
    except ValueError as e:  # load_text: no text files under a directory
        return f"task.data: {e}"
    return None
