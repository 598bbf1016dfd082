"""What runs a loaded model for its callers: the worker (the one thread that owns MLX),
the host (one loaded model and its per-request services), loading (folder -> ready
model, memory plan first), chat sessions (prompt ids, caches, prefix reuse), the memory
plan and budget, and ``inspect``'s model description."""
