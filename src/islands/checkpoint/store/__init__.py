"""islands.checkpoint.store: where a checkpoint's bytes go and how they survive.

directory     CheckpointStore: versioned, fsynced, checksummed step directories; dedup; retention; `latest`
manifest      the per-rank checksummed JSON manifest; mismatch reporting
tree          state trees <-> JSON skeleton + named tensors (no pickle); host staging copies
fsio          write+fsync, directory fsync, atomic pointer replace, fault points
replicas      data-parallel replicas written once (the exchanges of a multi-rank save)
packed        a whole state tree as one checksummed bytes object
levels        memory / local disk / remote levels, restore from the newest intact (SOTA-057)
peer          the memory level held by the next rank too
async_writer  two-phase snapshot-then-persist (SOTA-056)
model_dir     the model a run ends with (RUN_DIR/model), written whole or not at all

Uses islands.checkpoint.codec for the tensors; nothing here imports islands.checkpoint.policy.
CheckpointStore's public home is islands.checkpoint; it is importable here as well.
"""

from islands.checkpoint.store.async_writer import AsyncCheckpointer, SaveHandle
from islands.checkpoint.store.directory import CheckpointStore as CheckpointStore, LoadedCheckpoint, SaveResult
from islands.checkpoint.store.levels import DiskLevel, MemoryLevel, MultiLevelCheckpointer, Restored
from islands.checkpoint.store.packed import pack_tree, unpack_tree
from islands.checkpoint.store.tree import copy_tree, flatten_tree, tree_nbytes, unflatten_tree

__all__ = [
    "LoadedCheckpoint",
    "SaveResult",
    "AsyncCheckpointer",
    "SaveHandle",
    "DiskLevel",
    "MemoryLevel",
    "MultiLevelCheckpointer",
    "Restored",
    "pack_tree",
    "unpack_tree",
    "copy_tree",
    "flatten_tree",
    "unflatten_tree",
    "tree_nbytes",  # bytes of a state tree's tensors: what a save has to move before encoding
]
