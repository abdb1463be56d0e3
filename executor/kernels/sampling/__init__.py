"""Token sampling: greedy, temperature and top-k with a counter-based RNG, one row per request.
"""
