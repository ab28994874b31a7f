// Index walkers of the CUDA kernels: they step through a section's elements
// without an integer division per element (slow on GPUs). Host and device
// code, so that kernels/cuda_index_test.cc checks them on any machine.
#ifndef KVCACHE_KERNELS_CUDA_CODEC_CUDA_INDEX_H_
#define KVCACHE_KERNELS_CUDA_CODEC_CUDA_INDEX_H_

#include <cstdint>

#include "kernels/half.h"  // KVCACHE_HD

namespace kvcache::kernels::cuda::internal {

// k = start, start + step, ... split into (row, col) = (k / cols, k % cols).
struct RowWalker {
  uint32_t row, col;
  uint32_t drow, dcol, cols;
  KVCACHE_HD RowWalker(uint32_t start, uint32_t step, uint32_t cols_)
      : row(start / cols_),
        col(start % cols_),
        drow(step / cols_),
        dcol(step % cols_),
        cols(cols_) {}
  KVCACHE_HD void Next() {
    row += drow;
    col += dcol;
    if (col >= cols) {
      col -= cols;
      ++row;
    }
  }
};

// The KIVI metadata index of elements e0, e0 + 1, ... of a section
// (see codec.h): keys (g*H + h)*D + d = (t / G)*HD + c with c = e % HD;
// values e / G.
struct KiviGroupWalker {
  bool key;
  uint32_t hd, g_size;
  uint32_t a, b;      // keys: token t, channel c; values: group, offset
  uint32_t key_base;  // keys: (t / G) * HD
  KVCACHE_HD KiviGroupWalker(bool key_, uint32_t hd_, uint32_t group_size,
                             uint32_t e0)
      : key(key_), hd(hd_), g_size(group_size) {
    if (key) {
      a = e0 / hd;
      b = e0 - a * hd;
      key_base = (a / g_size) * hd;
    } else {
      a = e0 / g_size;
      b = e0 - a * g_size;
      key_base = 0;
    }
  }
  KVCACHE_HD uint32_t group() const { return key ? key_base + b : a; }
  KVCACHE_HD void Next() {
    ++b;
    if (key) {
      if (b == hd) {
        b = 0;
        ++a;
        key_base = (a / g_size) * hd;
      }
    } else if (b == g_size) {
      b = 0;
      ++a;
    }
  }
};

}  // namespace kvcache::kernels::cuda::internal

#endif  // KVCACHE_KERNELS_CUDA_CODEC_CUDA_INDEX_H_
