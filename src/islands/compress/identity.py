"""No compression: the tensor itself, all-reduced. The baseline every compressor is measured against."""

from __future__ import annotations

from torch import Tensor

from islands.compress.base import Agreed, Combine, CompressorBase, Payload, nbytes_of, numel_of


class NoCompression(CompressorBase):
    name = "none"
    combine = Combine.SUMMABLE

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        return Payload([tensor.detach().contiguous().reshape(-1)], tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        return payload.tensors[0].reshape(payload.shape).to(payload.dtype)

    def payload_nbytes(self, shape, dtype) -> int:
        return nbytes_of(numel_of(shape), dtype)
