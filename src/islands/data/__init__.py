"""Corpora that need no download and sharded, resumable loaders."""

from islands.data.corpus import Digits, TextCorpus, load_digits, load_text
from islands.data.loader import ArrayLoader, ShardSampler, WindowLoader

__all__ = ["Digits", "TextCorpus", "load_digits", "load_text", "ArrayLoader", "ShardSampler", "WindowLoader"]
