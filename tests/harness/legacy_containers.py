"""Compressed safetensors files in the container formats earlier islands wrote, for the tests that check
they still load (the tensor blobs' own older formats are in legacy_blobs.py).

V1_FILE was written by `islands ckpt compress` at git 6b44bf4 (container format 1, before issue #20 item 7's
format 2) from the file `v1_source()` makes with safetensors 0.8.0; V1_SOURCE_SHA256 is that source
file's SHA-256, so the restored bytes are checked exactly. `write_v1` is the format 1 writer of that
version, for tests that need other format 1 files (damaged ones, other tensors).
"""

import base64
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from islands.checkpoint.codec.safetensors_codec import _as_tensor, read_safetensors_header
from islands.checkpoint.codec.tensor import encode_tensor

V1_SOURCE_SHA256 = "1ca9899ee1f4ff9728ce78bed59dcad4a583fa9c5a152f3dd705b07deef7f60b"
V1_FILE = base64.b64decode(
    "SVNMUwEAAACbBAAAAAAAAHsiaGVhZGVyIjogIntcIl9fbWV0YWRhdGFfX1wiOntcIm5vdGVcIjpcImtlcHRcIn0sXCJpXCI6e1wi"
    "ZHR5cGVcIjpcIkk2NFwiLFwic2hhcGVcIjpbN10sXCJkYXRhX29mZnNldHNcIjpbMCw1Nl19LFwiZFwiOntcImR0eXBlXCI6XCJG"
    "NjRcIixcInNoYXBlXCI6WzVdLFwiZGF0YV9vZmZzZXRzXCI6WzU2LDk2XX0sXCJlXCI6e1wiZHR5cGVcIjpcIkYzMlwiLFwic2hh"
    "cGVcIjpbMCw0XSxcImRhdGFfb2Zmc2V0c1wiOls5Niw5Nl19LFwid1wiOntcImR0eXBlXCI6XCJGMzJcIixcInNoYXBlXCI6WzEy"
    "LDhdLFwiZGF0YV9vZmZzZXRzXCI6Wzk2LDQ4MF19LFwiYlwiOntcImR0eXBlXCI6XCJCRjE2XCIsXCJzaGFwZVwiOlszM10sXCJk"
    "YXRhX29mZnNldHNcIjpbNDgwLDU0Nl19LFwiaFwiOntcImR0eXBlXCI6XCJGMTZcIixcInNoYXBlXCI6WzMwXSxcImRhdGFfb2Zm"
    "c2V0c1wiOls1NDYsNjA2XX0sXCJtXCI6e1wiZHR5cGVcIjpcIkJPT0xcIixcInNoYXBlXCI6WzNdLFwiZGF0YV9vZmZzZXRzXCI6"
    "WzYwNiw2MDldfX0iLCAiZGF0YV9sZW4iOiA2MDksICJ0ZW5zb3JzIjogW3sibmFtZSI6ICJpIiwgImJlZ2luIjogMCwgImVuZCI6"
    "IDU2LCAib2Zmc2V0IjogMCwgImxlbmd0aCI6IDk3LCAiY3JjIjogMjA1Mjk3NDc3N30sIHsibmFtZSI6ICJkIiwgImJlZ2luIjog"
    "NTYsICJlbmQiOiA5NiwgIm9mZnNldCI6IDk3LCAibGVuZ3RoIjogMTY2LCAiY3JjIjogMzA0NTgwMjQ0OH0sIHsibmFtZSI6ICJl"
    "IiwgImJlZ2luIjogOTYsICJlbmQiOiA5NiwgIm9mZnNldCI6IDI2MywgImxlbmd0aCI6IDUyLCAiY3JjIjogMzMzODYzMzE3NX0s"
    "IHsibmFtZSI6ICJ3IiwgImJlZ2luIjogOTYsICJlbmQiOiA0ODAsICJvZmZzZXQiOiAzMTUsICJsZW5ndGgiOiAyNTAsICJjcmMi"
    "OiAxOTYyOTU0MDk0fSwgeyJuYW1lIjogImIiLCAiYmVnaW4iOiA0ODAsICJlbmQiOiA1NDYsICJvZmZzZXQiOiA1NjUsICJsZW5n"
    "dGgiOiAxNDQsICJjcmMiOiAyNzY3OTY2MzU5fSwgeyJuYW1lIjogImgiLCAiYmVnaW4iOiA1NDYsICJlbmQiOiA2MDYsICJvZmZz"
    "ZXQiOiA3MDksICJsZW5ndGgiOiAxMzAsICJjcmMiOiA5MzAwNzgwOTR9LCB7Im5hbWUiOiAibSIsICJiZWdpbiI6IDYwNiwgImVu"
    "ZCI6IDYwOSwgIm9mZnNldCI6IDgzOSwgImxlbmd0aCI6IDczLCAiY3JjIjogMjI5Mzc5MDAxOX1dLCAiZ2FwcyI6IFtdfTsAQ7JJ"
    "U0xUByA43QAAoAAAAQACAAMABAAFAAYAAAAAAAAABlQCAAMBDAEBAQf+Yag/zifgH7AiVFWFlf1XYbZhYx2WOW+0iJZy1zmMOAE4"
    "AAF6OCCDBWY+MhUmn4qhkkU0AAAASVNMVAcgBSkAAAB/f39/IAUpAAAAqsrg6iAFKQAAAKqqAKogBSkAAACqqgCqIAUpAAAAqqoA"
    "qiAFKQAAAKqqAKogBSkAAACqqgCqIAUpAAAAqqoAqgMAAQEFZCDCu7/73RLjd8BTfhzZFoIuaIWHExEYciCnW8ilFEMBKAAIaAUK"
    "aAUKaAUKaAUKaAUKaAUKaAUKaAUKIB+7xKnWxZiOOXtlSQAAAElTTFQHAAABAgAE/eMYFRMjep/1uDSasNCZx9ykew9Iz7fEBqbA"
    "/d3U/rQAjlqomicAAABJU0xUByAwDQEAwO7u7u7e3c3MzMy8u6uan6q7u8zMzMzd7gMQAEbMaygCIAEJAAAAIGABAwCgnJiUkIyI"
    "hID48Ojg2NDIwLiwqKCYkIiA8ODQwLCgkIDgwKCAwICAAAAAQAAgQGAAECAwQFBgcAAIEBggKDA4QEhQWGBocHgABAgMEBQYHCAk"
    "KCwwNDg8QERITFBUWFwgYEUAABAAAAEAOwEsIGBFAAAQAAABADsBLAAAAQIMCC5axeS67WKX6fYv2Ge2BrCv6sSVB9+thJfvBejr"
    "lMirAYADcQVwMCZ4AQZoYGVoYA1oYA2EamkQdtSfeq6gEgdCAAAASVNMVAcgIQkBAHx7e3t7e3t7e3p6enp5eXgAeHl5enp6ent7"
    "e3t7e3t7fCAhCQEAgPDg0MCwoJCA4MCggMCAgAAAAEAAIEBgABAgMEBQYHAAAQABASFmSdJNlazXPnTJ9NbhPjZk0P4iSvA1ToWl"
    "lXUGRX6zJwFCAAJoISZoISYL2plLjnRCLoil2K43AAAASVNMVAcgHvEAAL++vby6uLQANDg6PD0+P0BAQUFCQkNDREREREVFRSAe"
    "tQAAgAAAgACAAIAAgABAgMAAQIABADLAAgIAAQEeMxyzCUEiFEnsHUqxeQOnQXv7QYz7IIotzjjLNpXjC8QBPAACaB4jaB4b1HtL"
    "bOP/slsZKXIGNwAAAElTTFQHIAMZAAABAAEHAQEBA32V4VU7fhUkGlKJQraQRBTVpUi0ZcQIwkEN1HgYDN+ZAQMAAXoDCJ/brNW5"
    "rB3xT5HLJjQAAAA="
)


def v1_source() -> dict[str, torch.Tensor]:
    """The tensors of V1_FILE's source (saved with metadata {"note": "kept"}): exact in every dtype."""
    a = torch.arange(96, dtype=torch.float32)
    return {
        "w": ((a - 40) * 0.015625).reshape(12, 8),
        "h": ((a[:30] - 7) * 0.25).half(),
        "b": ((a[:33] - 16) * 0.0078125).bfloat16(),
        "i": torch.arange(7),
        "m": torch.tensor([True, False, True]),
        "e": torch.zeros(0, 4),
        "d": (a[:5].double() / 3),
    }


def write_v1(src, dst) -> int:
    """Container format 1 of safetensors file `src` into `dst`, as islands wrote it before format 2:
    b"ISLS" | u32 1 | u64 index length | index JSON | CRC-32 of the index | whole codec blobs (each with
    the SHA-256 of its tensor), the JSON holding the header text, the gaps in hex and per tensor its
    name, byte range, offset, length and CRC-32. Returns the file's size."""
    data = memoryview(Path(src).read_bytes())
    raw_header, header, start = read_safetensors_header(data)
    data_len = len(data) - start
    index, blobs, offset = [], [], 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        blob = encode_tensor(_as_tensor(np.frombuffer(bytearray(data[start + b : start + e]), dtype=np.uint8), info))
        index.append(
            {"name": name, "begin": b, "end": e, "offset": offset, "length": len(blob), "crc": zlib.crc32(blob)}
        )
        blobs.append(blob)
        offset += len(blob)
    gaps, pos = [], 0
    for b, e in sorted((t["begin"], t["end"]) for t in index):
        if b > pos:
            gaps.append([pos, b, bytes(data[start + pos : start + b]).hex()])
        pos = max(pos, e)
    if pos < data_len:
        gaps.append([pos, data_len, bytes(data[start + pos :]).hex()])
    meta = json.dumps(
        {"header": raw_header.decode("utf-8"), "data_len": data_len, "tensors": index, "gaps": gaps}
    ).encode()
    out = b"".join([struct.pack("<4sIQ", b"ISLS", 1, len(meta)), meta, struct.pack("<I", zlib.crc32(meta)), *blobs])
    Path(dst).write_bytes(out)
    return len(out)
