"""islands.checkpoint: checkpoints that never lose work (issue #6).

checkpointer     Checkpointer: the public face for a user's own training loop
settings         CheckpointSettings and the AutoInterval policy: what a job's checkpointing is, as values
driver           CheckpointDriver: levels, interval and async persist inside a loop; the TrainingState protocol
resume           exact resume across ranks, resharding N -> M for replicated state
codec            lossless dtype-aware tensor codec, exponent split + entropy coding (SOTA-437)
store            versioned, fsynced, checksummed directories; dedup; retention
async_writer     two-phase snapshot-then-persist (SOTA-056)
levels           memory / local disk / remote levels, restore from the newest intact (SOTA-057)
interval         CheckFreq overhead bound (SOTA-054) and Young/Daly from MTTF (SOTA-189)
"""

from islands.checkpoint.async_writer import AsyncCheckpointer, SaveHandle
from islands.checkpoint.checkpointer import Checkpointer
from islands.checkpoint.codec import TensorCodec, content_hash, decode_tensor, encode_tensor, tensor_bytes
from islands.checkpoint.driver import CheckpointDriver, TrainingState
from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.fingerprint import fingerprint_of
from islands.checkpoint.interval import (
                                         DEFAULT_DEVICE_MTBF_DAYS,
                                         CheckFreqPolicy,
                                         CombinedIntervalPolicy,
                                         IntervalDecision,
                                         YoungDalyInterval,
                                         checkfreq_interval,
                                         expected_waste_fraction,
                                         young_daly_seconds,
)
from islands.checkpoint.interval_sim import SimulationResult, simulate_failures
from islands.checkpoint.levels import DiskLevel, MemoryLevel, MultiLevelCheckpointer, Restored
from islands.checkpoint.packed import pack_tree, unpack_tree
from islands.checkpoint.resume import check_resume, resume
from islands.checkpoint.safetensors_codec import compress_file, decompress_file
from islands.checkpoint.settings import AutoInterval, CheckpointSettings, parse_policy
from islands.checkpoint.store import CheckpointStore, LoadedCheckpoint, SaveResult
from islands.checkpoint.tree import copy_tree, flatten_tree, tree_nbytes, unflatten_tree

__all__ = [
    "CheckpointSettings", "AutoInterval", "TrainingState", "CheckpointDriver", "parse_policy",
    "fingerprint_of", "resume", "check_resume",
    "AsyncCheckpointer", "SaveHandle", "TensorCodec", "content_hash", "decode_tensor", "encode_tensor",
    "CheckpointMismatch", "CorruptCheckpoint", "NoCheckpoint", "CheckFreqPolicy", "CombinedIntervalPolicy",
    "IntervalDecision", "YoungDalyInterval", "checkfreq_interval", "expected_waste_fraction",
    "young_daly_seconds", "SimulationResult", "simulate_failures", "DiskLevel", "MemoryLevel",
    "MultiLevelCheckpointer", "Restored", "pack_tree", "unpack_tree", "compress_file", "decompress_file",
    "CheckpointStore", "LoadedCheckpoint", "SaveResult", "copy_tree", "flatten_tree", "unflatten_tree",
    "tensor_bytes",  # the exact bytes the codec stores for a tensor (what content_hash hashes)
    "tree_nbytes",  # bytes of a state tree's tensors: what a save has to move before encoding
    "DEFAULT_DEVICE_MTBF_DAYS",  # the per-device MTBF YoungDalyInterval assumes (LIT-222)
]
