"""How our CUDA kernels reach MLX's runtime compiler: under a name that changes with their source,
and, where asked, with launch bounds.

MLX keeps a compiled custom kernel by its name alone (with the launch's template constants), in
memory and in its compiled-kernel cache on disk (``MLX_PTX_CACHE_DIR``, a folder under the
temporary directory by default). A source changed under the same name, by a new version of
the engine or by a switch that adds a ``#define`` (``MLX_DESK_QMV_PREFETCH``), would run the
old build, across processes too: an A/B of two variants in two runs would time one of them
twice. ``cuda_kernel`` names each build after a digest of its header and source.

MLX wraps a kernel's body in ``__global__ void name(...)`` with no launch bounds, so the
compiler sizes its registers for any block: it gave the one-row product 120 registers a
thread where 56 do with bounds of one 128-thread block (NVIDIA's compiler for sm_90), which
caps a multiprocessor at 16 warps instead of 36. ``launch_bounds`` gives a header that
redefines ``__global__`` (a macro of CUDA's own headers, which the header follows) to carry
them. Each build is its own module, so the redefinition reaches that kernel only.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx


def digest(*texts: str) -> str:
    """Eight hex digits that change with any of ``texts``."""
    return hashlib.sha256("\0".join(texts).encode()).hexdigest()[:8]


def cuda_kernel(name: str, input_names, output_names, source: str, header: str = "", **options):
    """``mx.fast.cuda_kernel`` under ``name`` and the digest of ``header`` and ``source``."""
    return mx.fast.cuda_kernel(
        name=f"{name}_{digest(header, source)}",
        input_names=list(input_names),
        output_names=list(output_names),
        source=source,
        header=header,
        **options,
    )


def launch_bounds(threads: int, blocks_per_multiprocessor: int = 0) -> str:
    """A header line that gives the kernel after it ``__launch_bounds__(threads[, blocks])``:
    at most ``threads`` a block, and registers few enough for ``blocks_per_multiprocessor``
    blocks a multiprocessor where that is given."""
    bounds = f"{threads}, {blocks_per_multiprocessor}" if blocks_per_multiprocessor else f"{threads}"
    return f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({bounds})\n"
