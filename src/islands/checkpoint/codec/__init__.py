"""islands.checkpoint.codec: the lossless, dtype-aware tensor codec and its formats (SOTA-437, LIT-750).

tensor             encode_tensor / decode_tensor, TensorCodec: the blob (format 7; formats 3-6 still read)
blob_header        the blob's binary header (formats 6 and 7)
streams            each byte plane as a zstd frame or a raw plane; the stored-bytes checksum
layouts            how each float dtype is cut into byte planes, and put back together
planes             exponent pair packing; per-thread scratch
kernels            the compiled (numba) split and join loops, imported on first use
safetensors_codec  a whole .safetensors file compressed and restored byte for byte (islands ckpt compress)

Below the store and the policy: nothing here imports islands.checkpoint.store or islands.checkpoint.policy.
"""

from islands.checkpoint.codec.tensor import TensorCodec, content_hash, decode_tensor, encode_tensor, tensor_bytes

__all__ = ["TensorCodec", "content_hash", "decode_tensor", "encode_tensor", "tensor_bytes"]
