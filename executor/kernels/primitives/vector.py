"""16-byte vector loads and stores for the bandwidth-bound row kernels.

No public numba-cuda API issues a 16-byte load (cache-hint loads stop at 8
bytes), and a row kernel that moves 2-byte elements one at a time reaches
about a third of an H200's copy bandwidth. ``load_vector`` / ``store_vector``
move one 16-byte chunk between an array and a small local buffer of 32-bit
words:

    load_vector(src, index, words, start)    words[start : start + 4] <- the chunk at src[index]
    store_vector(dst, index, words, start)   the chunk at dst[index] <- words[start : start + 4]

where ``index`` is a tuple with one integer per axis and the chunk is the
``lanes`` elements ``src[index[:-1], index[-1] + k]``, k < lanes (4 float32 or
8 bf16-as-int16 elements). The buffer holds the chunk's bytes as they lie in
memory: float32 words for float32 storage, int32 words packing two bf16 for
bf16 storage (one register per two elements; a buffer of int16 elements takes
a register per element and halves the rows an SM keeps in flight). Kernels
read and write elements of a buffer through ``get_lane`` / ``put_lane``
(``build_lanes``), lane ``j`` being element ``j % lanes`` of chunk ``j // lanes``.

The chunk must be 16-byte aligned in memory: a launcher proves it for every
chunk a kernel touches (``vector_aligned``) and falls back to its scalar
kernel otherwise. Kernels index buffers with constants once their ``range``
loops over lanes and unrolled chunks are unrolled, so buffers live in
registers (the sm_90 compile tests check that no local memory is used).

On the GPU both are llvmlite intrinsics: the element pointer cast to a global
``<4 x i32>*`` and one load or store aligned to 16. The simulator cannot run
custom intrinsics, so there they are plain device functions copying the same
bytes element by element, and they assert the 16-byte alignment the GPU
needs: the simulator runs the vector kernels' own logic, and a launcher that
wrongly picks the vector path fails there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from llvmlite import ir

from executor.kernels.primitives.codec import Codec
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int16, int32, types  # noqa: E402  (after load_cuda's numpy fix)

VECTOR_BYTES = 16
VECTOR_WORDS = VECTOR_BYTES // 4  # 32-bit words per chunk: a buffer holds this many per chunk


def lanes_for(codec: Codec) -> int:
    """Elements per 16-byte chunk in ``codec``'s storage (4 for float32, 8 for bf16 bits)."""
    return VECTOR_BYTES // np.dtype(codec.storage_numpy_dtype).itemsize


def word_type(codec: Codec) -> Any:
    """The numba type of a chunk buffer's words: float32 for float32 storage, int32 (two bf16) otherwise."""
    return float32 if np.dtype(codec.storage_numpy_dtype) == np.float32 else int32


def build_lanes(codec: Codec) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Device functions ``get_lane(words, j) -> element`` and ``put_lane(words, j, element)``.

    Elements are in the codec's storage type (what ``codec.load`` takes and
    ``codec.store`` returns). Little-endian: the element at the lower address is
    the low half of its word.
    """
    if np.dtype(codec.storage_numpy_dtype) == np.float32:

        @cuda.jit(device=True, inline=True)
        def get_word(words, j):
            return words[j]

        @cuda.jit(device=True, inline=True)
        def put_word(words, j, element):
            words[j] = element

        return get_word, put_word

    @cuda.jit(device=True, inline=True)
    def get_half(words, j):
        word = words[j // 2]
        bits = (word >> 16) & 0xFFFF if j % 2 else word & 0xFFFF
        if bits >= 0x8000:  # the int16 with these bits (a plain cast of 0x8000.. overflows in numpy)
            bits -= 0x10000
        return int16(bits)

    @cuda.jit(device=True, inline=True)
    def put_half(words, j, element):
        w = j // 2
        bits = int32(element) & 0xFFFF
        if j % 2:
            # -65536 is 0xFFFF0000 as an int32: keep the other half's bits.
            words[w] = int32((words[w] & 0xFFFF) | (bits << 16))
        else:
            words[w] = int32((words[w] & -65536) | bits)

    return get_half, put_half


# ---------------------------------------------------------------- host-side alignment checks


@dataclass(frozen=True)
class ArrayLayout:
    """Where an array's elements lie: data address, shape, strides in bytes, element size in bytes."""

    address: int
    shape: tuple[int, ...]
    strides_bytes: tuple[int, ...]
    itemsize_bytes: int


def array_layout(a: Any) -> ArrayLayout:
    """The layout of a kernel argument: torch tensor, numba device array, simulator array or numpy array."""
    shape = tuple(int(n) for n in a.shape)
    if hasattr(a, "data_ptr"):  # torch: strides in elements
        itemsize = a.element_size()
        return ArrayLayout(a.data_ptr(), shape, tuple(s * itemsize for s in a.stride()), itemsize)
    itemsize = int(a.dtype.itemsize)
    strides = tuple(int(s) for s in a.strides)
    if hasattr(a, "device_ctypes_pointer"):  # numba DeviceNDArray (value None when empty)
        return ArrayLayout(a.device_ctypes_pointer.value or 0, shape, strides, itemsize)
    # numpy, or the simulator's FakeCUDAArray (which forwards attributes to its numpy array)
    return ArrayLayout(int(a.__array_interface__["data"][0]), shape, strides, itemsize)


def _torch_layout(a: Any) -> tuple[int, Any, tuple[int, ...], int]:
    """(address, shape, strides in elements, element bytes) of a torch tensor: the launchers' common case,
    read without building an ArrayLayout (these checks run on every launch)."""
    return a.data_ptr(), a.shape, a.stride(), a.element_size()


def contiguous_aligned(*arrays: Any) -> bool:
    """Whether every array is C-contiguous from a 16-byte aligned address: the vector kernels' need.
    Unlike vector_aligned, rows need not be whole chunks (the kernels align each row)."""
    for a in arrays:
        if hasattr(a, "data_ptr"):
            address, shape, strides, itemsize = _torch_layout(a)
            if address % VECTOR_BYTES:
                return False
            expected = 1
            for length, stride in zip(reversed(shape), reversed(strides)):
                if length > 1 and stride != expected:
                    return False
                expected *= length
            continue
        layout = array_layout(a)
        if layout.address % VECTOR_BYTES:
            return False
        expected = layout.itemsize_bytes
        for length, stride in reversed(tuple(zip(layout.shape, layout.strides_bytes))):
            if length > 1 and stride != expected:
                return False
            expected *= length
    return True


def vector_aligned(*arrays: Any) -> bool:
    """True when every 16-byte chunk of the last axis of every array is 16-byte aligned.

    That is: the data address is a multiple of 16, the last axis is contiguous
    and a whole number of chunks long, and every other axis steps by a multiple
    of 16 bytes (an axis of length 1 is never stepped, so its stride is free).
    """
    for a in arrays:
        if hasattr(a, "data_ptr"):
            address, shape, strides, itemsize = _torch_layout(a)
            if not shape or address % VECTOR_BYTES:
                return False
            length = shape[-1]
            if (length * itemsize) % VECTOR_BYTES or (length > 1 and strides[-1] != 1):
                return False
            for n, stride in zip(shape[:-1], strides[:-1]):
                if n > 1 and (stride * itemsize) % VECTOR_BYTES:
                    return False
            continue
        layout = array_layout(a)
        if not layout.shape or layout.address % VECTOR_BYTES:
            return False
        *outer, (length, stride) = zip(layout.shape, layout.strides_bytes)
        if (length * layout.itemsize_bytes) % VECTOR_BYTES:
            return False
        if length > 1 and stride != layout.itemsize_bytes:
            return False
        if any(n > 1 and s % VECTOR_BYTES for n, s in outer):
            return False
    return True


def as_words(a: Any) -> Any:
    """The same bytes as int32 words (torch or numpy; last axis contiguous): a word packs two bf16
    (or int16 bits; the last axis then of even length) or holds one float32."""
    if hasattr(a, "data_ptr"):
        import torch

        return a.view(torch.int32)
    return a.view(np.int32)


# ---------------------------------------------------------------- device side


def build_vector_access() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(load_vector, store_vector)``: llvmlite intrinsics on the GPU, an emulation in the simulator."""
    if simulator_enabled():
        return _simulated_access()
    return _intrinsics()


def _simulated_access() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def chunk_elements(array, index):
        """The chunk's element indices, after checking its host address is 16-byte aligned."""
        address = int(array.__array_interface__["data"][0])
        for i, stride in zip(index, array.strides):
            address += int(i) * stride
        if address % VECTOR_BYTES:
            raise AssertionError(f"16-byte vector access at a misaligned address: index {tuple(index)}")
        lanes = VECTOR_BYTES // array.dtype.itemsize
        outer, first = tuple(int(i) for i in index[:-1]), int(index[-1])
        return [outer + (first + k,) for k in range(lanes)]

    @cuda.jit(device=True)
    def load_vector(src, index, words, start):
        elements = np.array([src[i] for i in chunk_elements(src, index)], dtype=src.dtype)
        for w, value in enumerate(elements.view(words.dtype)):
            words[start + w] = value

    @cuda.jit(device=True)
    def store_vector(dst, index, words, start):
        packed = np.array([words[start + w] for w in range(VECTOR_WORDS)], dtype=words.dtype)
        for i, value in zip(chunk_elements(dst, index), packed.view(dst.dtype)):
            dst[i] = value

    return load_vector, store_vector


def _check_vector_signature(name: str, array: Any, index: Any, words: Any, start: Any) -> None:
    """Typing-time checks shared by both intrinsics."""
    from numba.core.errors import TypingError

    if not isinstance(array, types.Array) or not isinstance(words, types.Array) or words.ndim != 1:
        raise TypingError(f"{name}: takes an array and a 1-D word buffer, got {array}, {words}")
    if not isinstance(array.dtype, (types.Integer, types.Float)) or (VECTOR_BYTES * 8) % array.dtype.bitwidth:
        raise TypingError(f"{name}: element type {array.dtype} does not divide {VECTOR_BYTES} bytes")
    if words.dtype not in (types.int32, types.float32):
        raise TypingError(f"{name}: the buffer must hold int32 or float32 words, got {words.dtype}")
    if not isinstance(index, types.BaseTuple) or len(index) != array.ndim:
        raise TypingError(f"{name}: index must be a tuple of {array.ndim} integers, got {index}")
    if not all(isinstance(i, types.Integer) for i in index) or not isinstance(start, types.Integer):
        raise TypingError(f"{name}: index and start must be integers, got {index}, {start}")


def element_pointer(context: Any, builder: Any, array_type: Any, array: Any, index_type: Any, index: Any) -> Any:
    """In an intrinsic's codegen: the (generic) pointer to ``array[index]``, ``index`` a tuple of integers."""
    from numba.cuda import cgutils

    values = cgutils.unpack_tuple(builder, index, count=len(index_type))
    indices = [context.cast(builder, value, ty, types.intp) for ty, value in zip(index_type, values)]
    struct = context.make_array(array_type)(context, builder, value=array)
    return cgutils.get_item_pointer(context, builder, array_type, struct, indices)


#: LLVM NVPTX address spaces of the memories a chunk can live in.
GLOBAL_SPACE, SHARED_SPACE = 1, 3


def _chunk_pointer(context: Any, builder: Any, array_type: Any, array: Any, index_type: Any, index: Any,
                   space: int = GLOBAL_SPACE) -> Any:
    """A ``<4 x i32> addrspace(space)*`` to the chunk at ``array[index]`` (kernel arguments are in global
    memory; a ``cuda.shared.array`` in shared memory)."""
    element = element_pointer(context, builder, array_type, array, index_type, index)
    vector = ir.VectorType(ir.IntType(32), VECTOR_WORDS)
    return builder.addrspacecast(builder.bitcast(element, vector.as_pointer()), vector.as_pointer(space))


def _word_pointers(context: Any, builder: Any, words_type: Any, words: Any, start_type: Any, start: Any) -> list:
    """Pointers to ``words[start + w]``, w < VECTOR_WORDS."""
    from numba.cuda import cgutils

    struct = context.make_array(words_type)(context, builder, value=words)
    first = context.cast(builder, start, start_type, types.intp)
    return [
        cgutils.get_item_pointer(context, builder, words_type, struct, [builder.add(first, first.type(w))])
        for w in range(VECTOR_WORDS)
    ]


def build_shared_vector_load() -> Callable[..., Any]:
    """``load_shared_vector(src, index, words, start)``: ``load_vector`` from a ``cuda.shared.array``
    (one ``ld.shared.v4``; the same emulation in the simulator)."""
    if simulator_enabled():
        return _simulated_access()[0]
    return _build_load(SHARED_SPACE)


def build_shared_vector_store() -> Callable[..., Any]:
    """``store_shared_vector(dst, index, words, start)``: ``store_vector`` into a ``cuda.shared.array``
    (one ``st.shared.v4``; the same emulation in the simulator)."""
    if simulator_enabled():
        return _simulated_access()[1]
    return _build_store(SHARED_SPACE)


def _build_load(space: int) -> Callable[..., Any]:
    from numba.cuda.extending import intrinsic

    lane_index = ir.IntType(32)

    @intrinsic
    def load_vector(typingctx, src, index, words, start):
        _check_vector_signature("load_vector", src, index, words, start)

        def codegen(context, builder, signature, args):
            src_type, index_type, words_type, start_type = signature.args
            src_value, index_value, words_value, start_value = args
            pointer = _chunk_pointer(context, builder, src_type, src_value, index_type, index_value, space)
            loaded = builder.load(pointer, align=VECTOR_BYTES)
            word = context.get_data_type(words_type.dtype)
            vector = builder.bitcast(loaded, ir.VectorType(word, VECTOR_WORDS))
            targets = _word_pointers(context, builder, words_type, words_value, start_type, start_value)
            for w, target in enumerate(targets):
                builder.store(builder.extract_element(vector, lane_index(w)), target)
            return context.get_dummy_value()

        return types.void(src, index, words, start), codegen

    return load_vector


def _intrinsics() -> tuple[Callable[..., Any], Callable[..., Any]]:
    return _build_load(GLOBAL_SPACE), _build_store(GLOBAL_SPACE)


def _build_store(space: int) -> Callable[..., Any]:
    from numba.cuda.extending import intrinsic

    lane_index = ir.IntType(32)

    @intrinsic
    def store_vector(typingctx, dst, index, words, start):
        _check_vector_signature("store_vector", dst, index, words, start)

        def codegen(context, builder, signature, args):
            dst_type, index_type, words_type, start_type = signature.args
            dst_value, index_value, words_value, start_value = args
            word = context.get_data_type(words_type.dtype)
            vector = ir.Constant(ir.VectorType(word, VECTOR_WORDS), ir.Undefined)
            sources = _word_pointers(context, builder, words_type, words_value, start_type, start_value)
            for w, source in enumerate(sources):
                vector = builder.insert_element(vector, builder.load(source), lane_index(w))
            pointer = _chunk_pointer(context, builder, dst_type, dst_value, index_type, index_value, space)
            builder.store(builder.bitcast(vector, pointer.type.pointee), pointer, align=VECTOR_BYTES)
            return context.get_dummy_value()

        return types.void(dst, index, words, start), codegen

    return store_vector
