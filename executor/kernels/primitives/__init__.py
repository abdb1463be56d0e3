"""Building blocks the kernels are made of: the launch path (``Kernel``: torch tensors in, cuda.core
launch), storage codecs, 16-byte vector access, reductions, elementwise grids, index helpers, fast
exponents, and the PTX pieces Numba does not expose (``mma.sync``, ``ldmatrix``, ``cp.async``, and
Hopper's warpgroup ``wgmma`` over core-matrix and swizzled shared tiles).
"""
