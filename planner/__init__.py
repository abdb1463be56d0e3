"""memplan's planner: configs in, a byte-exact memory plan out (pure Python, no torch)."""

__version__ = "0.1.0"
