"""The small-row kernel's code unpacking (``word_codes`` in models.quantized_matmul_cuda),
checked on any machine with a C++ compiler.

The kernel runs only on MLX's CUDA backend, but its unpacking is plain integer and float
bit work: a code at bit p is kept under the exponent of 2^(23 - p) and the float less
2^(23 - p) must be the code exactly, for every position of 4- and 8-bit words. The kernel's
device functions, as MLX receives them (``compact``), are compiled for the host with the few
CUDA names they use defined, and every code of a spread of words is compared with a shift
and mask.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from engine.models import quantized_matmul_cuda as qmv

COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

# The CUDA names the device functions use, for a host compiler.
_HOST = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <algorithm>
using std::min;
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct dim3 { int x, y, z; };
static dim3 threadIdx, blockIdx;
inline float __int_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
inline void __syncthreads() {}
"""

_CHECK = r"""
int main() {
  long wrong = 0, checked = 0;
  // A spread of words (a fixed stride), then every word whose codes are all equal.
  for (uint64_t w = 0; w < (1ull << 32); w += 2654435761ull % 9973 + 65521) {
    float four[8], eight[4];
    word_codes<4>((uint32_t)w, four);
    word_codes<8>((uint32_t)w, eight);
    for (int i = 0; i < 8; ++i) wrong += four[i] != (float)((w >> (4 * i)) & 15u);
    for (int i = 0; i < 4; ++i) wrong += eight[i] != (float)((w >> (8 * i)) & 255u);
    checked += 12;
  }
  for (uint32_t c = 0; c < 256; ++c) {
    float four[8], eight[4];
    const uint32_t nibbles = (c & 15u) * 0x11111111u, bytes = c * 0x01010101u;
    word_codes<4>(nibbles, four);
    word_codes<8>(bytes, eight);
    for (int i = 0; i < 8; ++i) wrong += four[i] != (float)(c & 15u);
    for (int i = 0; i < 4; ++i) wrong += eight[i] != (float)c;
    checked += 12;
  }
  std::printf("%ld %ld\n", checked, wrong);
  return wrong != 0;
}
"""


@pytest.mark.skipif(COMPILER is None, reason="needs a C++ compiler")
def test_every_code_position_of_4_and_8_bit_words_unpacks_exactly(tmp_path):
    source = tmp_path / "codes.cpp"
    source.write_text(_HOST + qmv.compact(qmv._HEADER + qmv._PRODUCT) + _CHECK)
    binary = tmp_path / "codes"
    build = subprocess.run(
        [COMPILER, "-std=c++17", "-O1", "-w", str(source), "-o", str(binary)], capture_output=True, text=True
    )
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    checked, wrong = map(int, run.stdout.split())
    assert checked > 100_000 and wrong == 0 and run.returncode == 0


def test_the_source_mlx_receives_keeps_the_code_and_drops_the_comments():
    text = "  // why\n  int a = 1;  // trailing\n\n#pragma unroll\n  for (;;) {}\n"
    assert qmv.compact(text) == "int a = 1;\n#pragma unroll\nfor (;;) {}\n"
    compacted = qmv.compact(qmv._HEADER + qmv._PRODUCT)
    assert "//" not in compacted and "rows_product" in compacted and "word_codes" in compacted
    assert len(compacted) < 0.75 * len(qmv._HEADER + qmv._PRODUCT)
