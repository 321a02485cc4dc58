"""Tokenizers that need no download: a byte-level BPE trained on the run's own corpus, or plain bytes.

Both are `tokenizers.Tokenizer` objects with the same byte-level pre-tokenizer and decoder, so the rest of
islands (saving in the run directory, the vocabulary check, export in the Hugging Face format) treats them
alike:

    train_bpe(texts, vocab_size)   a byte-level BPE trained on `texts` (an iterable of strings); the 256
                                   byte symbols are always in its alphabet, so any text encodes
    byte_tokenizer()               ids 0..255 are the bytes themselves, 256 is the end-of-text token
    save(tok, path) / load(path)   tokenizer.json, written to a temporary sibling and renamed
    encode(tok, text)              token ids as an int32 numpy array
    check_fits(tok, rows)          a message when the tokenizer has ids the model's embedding has no row for

Training is deterministic: the same texts in the same order give the same tokenizer in any process and
with any number of threads (the `tokenizers` trainer breaks ties by the pair itself), which is what lets
every rank of a job train its own copy instead of waiting for rank 0 (islands.tasks.hf_lm).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"  # the one special token: end of text (GPT-2's spelling)
BYTE_VOCAB = 257  # 256 bytes + EOS
MIN_BPE_VOCAB = 257  # a BPE holds at least the 256 byte symbols and EOS
CHUNK = 1 << 16  # characters per piece of text handed to the trainer and the encoder


class TokenizerError(ValueError):
    """A tokenizer that cannot be built, read or used with this model; the message says what would work."""


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte value (index = byte), the mapping byte-level BPEs use:
    bytes that are printable Latin-1 characters stand for themselves, the others (control characters, space,
    a few Latin-1 gaps) take the code points from 256 upwards, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _byte_level(tok, use_regex: bool):
    from tokenizers import decoders, pre_tokenizers, processors

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def byte_tokenizer():
    """Bytes as tokens: id b for byte b (0..255), id 256 for EOS; no merges, nothing learnt."""
    from tokenizers import Tokenizer, models

    vocab = {sym: b for b, sym in enumerate(byte_symbols())}
    tok = _byte_level(Tokenizer(models.BPE(vocab=vocab, merges=[])), use_regex=False)
    tok.add_special_tokens([EOS])
    return tok


def chunks(text: str, size: int = CHUNK) -> Iterator[str]:
    """`text` in pieces of about `size` characters, each ending at a line break where there is one."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        yield text[start:end]
        start = end


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE of at most `vocab_size` tokens (EOS is id 0, then the 256 byte symbols, then merges)
    trained on `texts`; fewer tokens when the text holds fewer distinct pairs worth merging."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it holds the 256 byte "
            f"symbols and {EOS} before any merge; use vocab_size >= {MIN_BPE_VOCAB}"
        )
    tok = _byte_level(Tokenizer(models.BPE()), use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    seen = [0]

    def counted() -> Iterator[str]:
        for text in texts:
            for piece in chunks(text):
                seen[0] += len(piece)
                yield piece

    tok.train_from_iterator(counted(), trainer=trainer)
    if seen[0] == 0:
        raise TokenizerError("cannot train a tokenizer on an empty corpus: the training text holds no characters")
    return tok


def vocab_size(tok) -> int:
    """Ids the tokenizer can produce: its vocabulary with its special tokens."""
    return int(tok.get_vocab_size(with_added_tokens=True))


def eos_id(tok) -> int:
    i = tok.token_to_id(EOS)
    if i is None:
        raise TokenizerError(f"the tokenizer has no {EOS} token; islands' tokenizers end texts with it")
    return int(i)


def check_fits(tok, rows: int, where: str = "the tokenizer") -> str | None:
    """A message when `tok` produces ids the model's embedding (`rows` rows) has no row for, else None.
    A tokenizer smaller than the embedding is fine: the extra rows are simply never looked up."""
    n = vocab_size(tok)
    if n > rows:
        return (
            f"{where} has {n} tokens but the model's embedding has {rows} rows: ids {rows}..{n - 1} would "
            f"index past it; give the model vocab_size >= {n} (task.vocab_size or model_overrides) or a "
            "tokenizer of at most that many tokens"
        )
    return None


def encode(tok, text: str) -> np.ndarray:
    """Token ids of `text` as int32, encoded piece by piece (pieces end at line breaks)."""
    pieces = list(chunks(text))
    if not pieces:
        return np.zeros(0, dtype=np.int32)
    ids = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(pieces, add_special_tokens=False)]
    return np.concatenate(ids)


def digest(tok) -> str:
    """A short hash of the tokenizer's full definition: equal digests, equal tokenizers."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def save(tok, path: str | os.PathLike) -> Path:
    """Write `tok` to `path` (tokenizer.json) through a temporary sibling and a rename: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(tok.to_str())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load(path: str | os.PathLike):
    """A tokenizer.json (or a directory holding one); TokenizerError when there is none or it does not parse."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(f"no tokenizer at {str(p)!r}: give a tokenizer.json file or a directory holding one")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception types
        raise TokenizerError(f"{str(p)!r} is not a tokenizer file the tokenizers library reads: {e}") from None
