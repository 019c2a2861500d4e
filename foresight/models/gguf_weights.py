"""A GGUF file's 4-bit linear weights as they ship, for the int4 kernels (models/int4_linear.py).

GGUF's Q4_0 and Q4_1 store a weight matrix [out, in] in blocks of 32 consecutive inputs of one row, each
with an fp16 scale `d` and 32 codes q in 0..15 packed two to a byte (element j in the low nibble of byte j,
element j + 16 in its high nibble). Q4_1 adds an fp16 minimum `m`: w = d * q + m; Q4_0 has w = d * (q - 8),
which is Q4_1 with m = -8 d. `Q4Weight` holds both in the Q4_1 form; `dequantize` computes exactly what the
`gguf` package (and so transformers' GGUF loader) computes, float32 `d * q + m`.

llama.cpp's converter permutes the rows of a Llama's q and k projections (its RoPE pairs adjacent
dimensions, transformers' pairs halves); transformers undoes that when it loads the file, and so does
`read_q4_weights`. The permutation moves whole rows, so the blocks stay intact.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32  # inputs per block (and per scale): GGUF's QK4_0 = QK4_1
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # fp16 d (+ fp16 m), 16 bytes of codes
Q4_TYPES = tuple(BLOCK_BYTES)
# The module names a Llama's rows are permuted for (transformers' LlamaTensorProcessor; only "llama" files).
PERMUTED = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}


@dataclass(slots=True)
class Q4Weight:
    """A 4-bit weight [out, in] in groups of `BLOCK` inputs: w = d * q + m."""

    codes: torch.Tensor  # [out, in] uint8, 0..15
    d: torch.Tensor  # [out, in // BLOCK] float32 (fp16 values in a GGUF)
    m: torch.Tensor  # [out, in // BLOCK] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32, d * q + m (the gguf package's formula, so bit for bit its result)."""
        d = self.d.repeat_interleave(BLOCK, dim=1)
        m = self.m.repeat_interleave(BLOCK, dim=1)
        return d * self.codes.float() + m

    def rows(self, order: torch.Tensor) -> "Q4Weight":
        return Q4Weight(self.codes[order], self.d[order], self.m[order])

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Q4Weight":
        """Q4_1 of a dense weight [out, in] (in a multiple of BLOCK), as llama.cpp's reference quantizer does:
        per block m = min, d = (max - min) / 15, q = round((w - m) / d); d and m rounded to fp16."""
        out, inp = weight.shape
        if inp % BLOCK:
            raise ValueError(f"int4: a weight needs a multiple of {BLOCK} inputs, got {inp}")
        blocks = weight.detach().float().reshape(out, inp // BLOCK, BLOCK)  # [out, groups, BLOCK]
        low, high = blocks.amin(-1), blocks.amax(-1)  # [out, groups]
        d = (high - low) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = torch.trunc((blocks - low[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
        return cls(codes.reshape(out, inp), d.half().float(), low.half().float())


def _q4_blocks(data: np.ndarray, type_name: str, inp: int) -> Q4Weight:
    """`data` [out, bytes] uint8, the GGUF tensor's raw blocks."""
    out = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(out, inp // BLOCK, BLOCK_BYTES[type_name])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if type_name == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        packed = blocks[..., 4:]
    else:
        m = -8 * d
        packed = blocks[..., 2:]
    packed = torch.from_numpy(packed.copy())  # [out, groups, 16]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [out, groups, 32]: low nibbles first
    return Q4Weight(codes.reshape(out, inp), d, m)


def _llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """The order that undoes llama.cpp's q/k row permutation: new rows = old rows[order]."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


# GGUF's value types (gguf.GGUFValueType) with a fixed size, as struct formats.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class TensorEntry:
    """Where a GGUF tensor's data lies: its type name (e.g. "Q4_1"), its shape as GGUF gives it (inputs
    first) and its byte offset from the file's start."""

    type_name: str
    shape: tuple[int, ...]
    offset: int


class _Cursor:
    """Little-endian reads from a bytes buffer."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.read("Q")
        self.pos += size
        return self.data[self.pos - size:self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _FIXED:
            return self.read(_FIXED[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.read("I"), self.read("Q")
            if item in _FIXED:  # skipped whole: tokenizer scores and types are long
                self.pos += count * struct.calcsize(_FIXED[item])
                return None
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"GGUF: unknown value type {kind}")


@functools.lru_cache(maxsize=4)
def gguf_index(path: Path) -> tuple[str, dict[str, TensorEntry]]:
    """A GGUF file's architecture and tensor table, read from its header alone, once per process (`auto`
    asks whether it holds 4-bit weights, then they are read). (The gguf package's GGUFReader parses every
    metadata field through numpy views: 3.4 s for the embedded default's tokenizer, against ~0.1 s here.)"""
    from gguf import GGMLQuantizationType

    with open(path, "rb") as f:
        data = f.read(_header_bytes(path))
    cur = _Cursor(data)
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 8  # magic, version
    n_tensors, n_fields = cur.read("Q"), cur.read("Q")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.read("I"))
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        shape = tuple(cur.read("Q") for _ in range(cur.read("I")))
        entries.append((name, GGMLQuantizationType(cur.read("I")).name, shape, cur.read("Q")))
    align = fields.get("general.alignment") or 32
    start = -(-cur.pos // align) * align  # tensor data begins at the next multiple of the alignment
    return fields["general.architecture"], {n: TensorEntry(t, s, start + o) for n, t, s, o in entries}


def _header_bytes(path: Path) -> int:
    """Bytes that hold the header of any GGUF whose metadata is under 64 MiB (the tokenizer's, mostly)."""
    return min(path.stat().st_size, 64 << 20)


def q4_tensor_count(path: Path) -> int:
    """How many Q4_0/Q4_1 tensors the GGUF file holds."""
    return sum(t.type_name in Q4_TYPES for t in gguf_index(path)[1].values())


def read_q4_weights(gguf_path: Path, model) -> dict[str, Q4Weight]:
    """The Q4_0/Q4_1 weights of `gguf_path` by the name of the `model` module they belong to (a Hugging Face
    model of the file's architecture): e.g. "model.layers.0.mlp.down_proj". Weights of other types are left out."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_name, tensors = gguf_index(gguf_path)
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch_name), None)
    if arch is None:
        raise ValueError(f"int4: the gguf package does not know the architecture {arch_name!r} of {gguf_path}")
    config = model.config
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    found = {}
    file = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    for module_name, module in model.named_modules():
        gguf_name = names.get_name(module_name) if hasattr(module, "in_features") else None
        entry = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if entry is None or entry.type_name not in Q4_TYPES:
            continue
        weight = _q4_blocks(_tensor_bytes(file, entry), entry.type_name, entry.shape[0])
        leaf = module_name.rsplit(".", 1)[-1]
        if arch_name == "llama" and leaf in PERMUTED:
            weight = weight.rows(_llama_row_order(weight.shape[0], getattr(config, PERMUTED[leaf])))
        found[module_name] = weight
    return found


def _tensor_bytes(file: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """[out, bytes per row] uint8: a 4-bit tensor's blocks, row by row, from the mapped `file`."""
    inp, out = entry.shape[0], int(np.prod(entry.shape[1:]))
    row = inp // BLOCK * BLOCK_BYTES[entry.type_name]
    return file[entry.offset:entry.offset + out * row].reshape(out, row)
