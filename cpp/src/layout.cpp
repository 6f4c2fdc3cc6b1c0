#include "layout.hpp"

#include <cstdint>


namespace attnres::detail {

bool byte_extent(const TensorRef& t, int64_t& bytes) {
  bytes = 0;
  if (!t.present()) return true;
  int64_t last = 0;  // offset of the last element, in elements
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return true;
    if (t.shape[i] < 0 || t.strides[i] < 0) return false;
    int64_t step = 0;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.strides[i], &step) || __builtin_add_overflow(last, step, &last))
      return false;
  }
  if (__builtin_add_overflow(last, int64_t{1}, &last) || __builtin_mul_overflow(last, dtype_size(t.dtype), &bytes))
    return false;
  uintptr_t end = 0;
  return !__builtin_add_overflow(reinterpret_cast<uintptr_t>(t.data), static_cast<uintptr_t>(bytes), &end);
}

bool non_overlapping(const TensorRef& t) {
  int64_t bytes = 0;
  if (!byte_extent(t, bytes)) return false;
  if (t.numel() <= 1) return true;
  // Dimensions of size > 1, sorted by stride (insertion sort: at most kMaxRank entries).
  int order[kMaxRank];
  int n = 0;
  for (int i = 0; i < t.ndim && i < kMaxRank; ++i) {
    if (t.shape[i] <= 1) continue;
    int k = n++;
    while (k > 0 && t.strides[order[k - 1]] > t.strides[i]) {
      order[k] = order[k - 1];
      --k;
    }
    order[k] = i;
  }
  int64_t extent = 1;  // elements spanned by the dimensions already placed
  for (int k = 0; k < n; ++k) {
    const int d = order[k];
    if (t.strides[d] < extent) return false;
    // No overflow: byte_extent bounded the sum of every (shape - 1) * stride.
    extent = t.strides[d] * (t.shape[d] - 1) + extent;
  }
  return true;
}

bool overlaps(const TensorRef& a, const TensorRef& b) {
  uintptr_t alo, ahi, blo, bhi;
  a.byte_range(alo, ahi);
  b.byte_range(blo, bhi);
  return ranges_overlap(alo, ahi, blo, bhi);
}

TensorRef snapshot_rows(const TensorRef& bank, int64_t slot) {
  TensorRef rows = bank;
  rows.ndim = 2;
  rows.shape[0] = bank.shape[1];
  rows.shape[1] = bank.shape[2];
  rows.strides[0] = bank.strides[1];
  rows.strides[1] = bank.strides[2];
  rows.data = static_cast<char*>(bank.data) + slot * bank.strides[0] * dtype_size(bank.dtype);
  return rows;
}

}  // namespace attnres::detail
