"""How many bytes a model's caches take: per token of the full-attention layers, for the
sliding windows once full, and the recurrent layers' fixed state. Read from a family's args
(``kv_bytes_per_token``, ``kv_cache_layers``, ``layer_windows``, ``recurrent_state_bytes``
where it defines them), so memory plans need no weights."""

from __future__ import annotations


def kv_bytes_per_token(args, dtype_bytes: int) -> int:
    """KV bytes one more token costs, once every sliding window is full.

    Assumption: a sliding-window layer holds at most its window, so past that it costs
    nothing per token; its fixed cost is ``kv_window_bytes``. Full-attention layers
    cost 2 (K and V) x kv heads x head dim x dtype bytes per token each, unless the
    family's args say otherwise (``kv_bytes_per_token(dtype_bytes)``: latent caches).
    """
    own = getattr(args, "kv_bytes_per_token", None)
    if callable(own):  # a family whose cache is not keys and values per head (MLA's latent)
        return own(dtype_bytes)
    return sum(b for w, b in _cache_layers(args, dtype_bytes) if w is None)


def kv_window_bytes(args, dtype_bytes: int) -> int:
    """The fixed KV bytes of the sliding-window layers when their windows are full."""
    return sum(b * w for w, b in _cache_layers(args, dtype_bytes) if w is not None)


def kv_window_groups(args, dtype_bytes: int) -> list[tuple[int, int, int]]:
    """(window, layers, bytes per token of those layers) for each sliding window, smallest first."""
    groups: dict[int, tuple[int, int]] = {}
    for w, b in _cache_layers(args, dtype_bytes):
        if w is not None:
            n, total = groups.get(w, (0, 0))
            groups[w] = (n + 1, total + b)
    return [(w, n, total) for w, (n, total) in sorted(groups.items())]


def _cache_layers(args, dtype_bytes: int) -> list[tuple[int | None, int]]:
    """(window, KV bytes per token) of each layer that holds a cache. Families whose layers
    differ in shape, or share caches, say so with ``args.kv_cache_layers()`` ->
    [(window, kv heads, head dim)]; otherwise every layer has the config's one shape."""
    custom = getattr(args, "kv_cache_layers", None)
    if callable(custom):
        return [(w, 2 * n_kv * head_dim * dtype_bytes) for w, n_kv, head_dim in custom()]
    per_layer = _per_layer_token_bytes(args, dtype_bytes)
    return [(w, per_layer) for w in layer_windows(args)]


def recurrent_state_bytes(args, dtype_bytes: int) -> int:
    """Fixed bytes of the recurrent layers' state (conv inputs, delta-rule matrices), the
    same at any context length; 0 for a family without recurrent layers. Such a family's
    ``layer_windows`` lists its attention layers only."""
    fixed = getattr(args, "recurrent_state_bytes", None)
    return int(fixed(dtype_bytes)) if callable(fixed) else 0


def _per_layer_token_bytes(args, dtype_bytes: int) -> int:
    n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return 2 * n_kv * head_dim * dtype_bytes


def layer_windows(args) -> list[int | None]:
    """Each layer's sliding window (None = full attention), as the family defines it."""
    windows = getattr(args, "layer_windows", None)
    if callable(windows):
        return windows()
    return [None] * args.num_hidden_layers
