"""islands.checkpoint: checkpoints that never lose work (issue #6).

The public face, what a user of islands' checkpoints needs:
    islands.Checkpointer (importable here too)   checkpoints around a user's own training loop
    CheckpointSettings, AutoInterval              what a job's checkpointing is, as values
    resume, check_resume, fingerprint_of          put a training state back; check a checkpoint fits first
    CheckpointStore                               the checkpoint directories (list, load, verify)
    compress_file, decompress_file                a .safetensors file through the lossless codec and back
    CheckpointMismatch, CorruptCheckpoint, NoCheckpoint   the failures, each with its own fix

Three sub-packages, each importing only the ones before it (tests/unit/project/test_layering.py):
codec    the lossless dtype-aware tensor codec and its blob formats (SOTA-437)
store    where the bytes go and how they survive: directories, manifests, levels, async persist
policy   when and what to save, and resume: settings, interval policies, the driver, the Checkpointer
plus errors.py (below all three) and cli.py (`islands ckpt`, above them).
Names that left this face in 0.2.0 still resolve here, with a DeprecationWarning (docs/deprecations.md).
"""

from islands._deprecated import alias_getattr
from islands.checkpoint.codec.safetensors_codec import compress_file, decompress_file
from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.policy.checkpointer import Checkpointer  # noqa: F401 - public home: islands.Checkpointer
from islands.checkpoint.policy.fingerprint import fingerprint_of
from islands.checkpoint.policy.resume import check_resume, resume
from islands.checkpoint.policy.settings import AutoInterval, CheckpointSettings
from islands.checkpoint.store.directory import CheckpointStore

__getattr__ = alias_getattr(__name__)  # the names that moved to codec/store/policy: deprecated here

__all__ = [
    "CheckpointSettings",
    "AutoInterval",
    "resume",
    "check_resume",
    "fingerprint_of",
    "CheckpointStore",
    "compress_file",
    "decompress_file",
    "CheckpointMismatch",
    "CorruptCheckpoint",
    "NoCheckpoint",
]
