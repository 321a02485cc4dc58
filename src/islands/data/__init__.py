"""Corpora that need no download and sharded, resumable loaders."""

from islands.data.corpus import Digits, TextCorpus, load_digits, load_text
from islands.data.loader import ArrayLoader, ShardSampler, WindowLoader
from islands.data.source import batch_source

__all__ = [
    "Digits",
    "TextCorpus",
    "load_digits",
    "load_text",
    "ArrayLoader",
    "ShardSampler",
    "WindowLoader",
    "batch_source",
]  # batch_source: one rank's stream of any train data the Trainer takes, for loops of one's own
