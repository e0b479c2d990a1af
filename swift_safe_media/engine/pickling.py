"""How results are pickled so that their large buffers can leave the pickle stream.

Pickle protocol 5 hands out-of-band buffers to :mod:`.transport`, which sends them in a
memfd; these reducers make CPU tensors (strides and numpy-less dtypes such as bfloat16
kept), PIL images (their pixel data) and strided numpy arrays (the span they view, not
a copy) pickle as such buffers, and rebuild them as views on the receiving side.
"""

from __future__ import annotations

import pickle

from ..confinement.handed import HandedPath, hand_over


class Pickler(pickle.Pickler):
    """A pickler whose tensors, images and strided arrays travel out of band, and whose
    handed media paths travel as open descriptors (when ``handed`` is a list: a request)."""

    handed: list | None = None

    def reducer_override(self, obj):
        if type(obj) is HandedPath:
            return hand_over(obj, self.handed) if self.handed is not None else (HandedPath, (str(obj),))
        module = type(obj).__module__
        if module.startswith("torch"):
            return _reduce_tensor(obj)
        if module.startswith("PIL."):
            return _reduce_image(obj)
        if module == "numpy":
            return _reduce_strided_array(obj)
        return NotImplemented


def _reduce_tensor(obj):
    import torch

    if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.layout != torch.strided:
        return NotImplemented
    tensor = obj.detach()
    if any(step < 0 for step in tensor.stride()) or tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
    stand_in = _NUMPY_LESS_DTYPES.get(tensor.dtype)
    array = (tensor.view(stand_in) if stand_in else tensor).numpy()
    return _rebuild_tensor, (array, str(tensor.dtype).removeprefix("torch."), obj.requires_grad)


def _rebuild_tensor(array, dtype_name, requires_grad):
    import torch

    tensor = torch.from_numpy(array)
    dtype = vars(torch).get(dtype_name)  # the name comes from the sandbox: no module __getattr__
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {dtype_name!r}")
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _numpy_less_dtypes():
    try:
        import torch
    except ImportError:
        return {}
    # dtypes numpy cannot hold: carried as same-width integers, viewed back on arrival.
    found = {torch.bfloat16: torch.int16}
    for name, stand_in in (("float8_e4m3fn", torch.uint8), ("float8_e5m2", torch.uint8)):
        if hasattr(torch, name):
            found[getattr(torch, name)] = stand_in
    return found


class _LazyDtypes(dict):
    def get(self, key, default=None):
        if not self:
            self.update(_numpy_less_dtypes())
        return super().get(key, default)


_NUMPY_LESS_DTYPES = _LazyDtypes()

_IMAGE_MODES_BY_BUFFER = {"1", "L", "LA", "P", "RGB", "RGBA", "RGBX", "CMYK", "I", "F", "I;16"}


def _reduce_image(obj):
    from PIL import Image

    if not isinstance(obj, Image.Image) or obj.mode not in _IMAGE_MODES_BY_BUFFER:
        return NotImplemented
    obj.load()
    palette = obj.getpalette(rawmode="RGBA") if obj.mode == "P" else None
    pixels = pickle.PickleBuffer(obj.tobytes())
    return _rebuild_image, (obj.mode, obj.size, pixels, dict(obj.info), palette)


def _rebuild_image(mode, size, pixels, info, palette):
    from PIL import Image

    if size[0] * size[1] > 8 * len(pixels):  # a pixel takes a bit at least: never allocate past the data
        raise ValueError(f"{len(pixels)} bytes of pixels for a {size} image")
    if mode == "1":  # the raw decoder packs bits; frombuffer cannot share them
        image = Image.frombytes(mode, size, bytes(pixels))
    else:
        image = Image.frombuffer(mode, size, pixels, "raw", mode, 0, 1)
    if palette is not None:
        image.putpalette(palette, rawmode="RGBA")
    image.info.update(info)
    return image


def _reduce_strided_array(obj):
    """numpy pickles a non-contiguous array by copying it into the stream; send the
    memory span it views instead, so transposed decoder output keeps its strides."""
    import numpy as np

    if type(obj) is not np.ndarray or obj.flags.c_contiguous or obj.flags.f_contiguous:
        return NotImplemented
    if obj.dtype.hasobject or obj.size == 0 or any(s < 0 for s in obj.strides):
        return NotImplemented
    span = sum((n - 1) * s for n, s in zip(obj.shape, obj.strides)) + obj.itemsize
    if span > 2 * obj.nbytes:
        return NotImplemented
    # A view on the same memory; encode() keeps the pickled object alive until copied.
    start = obj.__array_interface__["data"][0]
    flat = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * span).from_address(start))
    return _rebuild_strided_array, (flat, obj.dtype.str, obj.shape, obj.strides)


def _rebuild_strided_array(flat, dtype, shape, strides):
    import numpy as np

    dtype = np.dtype(dtype)
    if dtype.hasobject:  # object pointers read from shared memory: the sender's to forge
        raise TypeError("an object array cannot be rebuilt from memory")
    return np.ndarray(shape, dtype, buffer=flat, strides=strides)
