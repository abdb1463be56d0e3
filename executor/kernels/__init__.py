"""Numba-CUDA kernels, by family. Each launcher class runs one kernel; executor.routing decides
which launcher serves a step.
"""
