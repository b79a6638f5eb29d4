"""A small .safetensors reader and writer on numpy (no safetensors package).

    write_safetensors("io.safetensors", {"queries": q, "valid_lens": np.int32([3, 2])})
    tensors = read_safetensors("io.safetensors")    # name -> numpy array

The format: an 8-byte little-endian header length, a JSON header mapping each name
to {dtype, shape, data_offsets} (plus "__metadata__", strings only), padded with
spaces to 8 bytes, then the tensors' little-endian bytes back to back.
"""

import json
import struct

import numpy as np

_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
           "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _as_numpy(value):
    if hasattr(value, "detach"):  # a torch.Tensor, without importing torch
        value = value.detach().cpu().contiguous().numpy()
    return np.asarray(value)


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> numpy array or torch.Tensor. float32/float64/int32/... keep
    their dtype (little-endian, C order); torch's bfloat16 is written as F32."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        if hasattr(value, "dtype") and str(value.dtype) == "torch.bfloat16":
            value = value.float()
        array = _as_numpy(value)
        dtype = _NAMES.get(array.dtype.newbyteorder("<")) or _NAMES.get(array.dtype)
        if dtype is None:
            raise TypeError(f"{name}: dtype {array.dtype} has no safetensors name")
        data = np.ascontiguousarray(array, dtype=_DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    """name -> numpy array (native byte order; BF16 is widened to float32)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: {len(blob)} bytes, not a safetensors file")
    (length,) = struct.unpack("<Q", blob[:8])
    if 8 + length > len(blob):
        raise ValueError(f"{path}: header of {length} bytes runs past the end of the file")
    header = json.loads(blob[8:8 + length])
    data = memoryview(blob)[8 + length:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if entry["dtype"] == "BF16":
            bits = np.frombuffer(data[begin:end], dtype="<u2").astype(np.uint32) << 16
            array = bits.view(np.float32)
        elif entry["dtype"] in _DTYPES:
            array = np.frombuffer(data[begin:end], dtype=_DTYPES[entry["dtype"]])
        else:
            raise ValueError(f"{path}: {name}: unsupported dtype {entry['dtype']}")
        if array.size != int(np.prod(shape)):
            raise ValueError(f"{path}: {name}: {array.size} values for shape {shape}")
        tensors[name] = array.reshape(shape).astype(array.dtype.newbyteorder("="))
    return tensors
