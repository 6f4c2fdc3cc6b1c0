// Layout helpers shared by validation and the backends.
#pragma once

#include <cstdint>

#include "attnres/tensor.hpp"

namespace attnres::detail {

// The bytes [data, data + bytes) the view can touch (0 for an empty view), computed with overflow checks: false
// when the extent does not fit in int64 or data + bytes wraps the address space (no memory can back such a
// view, and offsets computed from it would wrap onto other elements). Assumes non-negative strides.
bool byte_extent(const TensorRef& t, int64_t& bytes);

// True when no two indices of the view map to the same element (sufficient test: dimensions sorted by
// stride, each stride at least the extent of the smaller ones). Assumes non-negative strides. A view whose
// extent overflows (byte_extent false) overlaps: its wrapped addresses coincide.
bool non_overlapping(const TensorRef& t);

// True when two byte ranges [lo, hi) intersect; an empty range ({0, 0}, TensorRef::byte_range of an empty view)
// intersects nothing.
inline bool ranges_overlap(uintptr_t alo, uintptr_t ahi, uintptr_t blo, uintptr_t bhi) {
  return alo != ahi && blo != bhi && alo < bhi && blo < ahi;
}

// True when the byte ranges the two views can touch intersect (conservative for interleaved views).
bool overlaps(const TensorRef& a, const TensorRef& b);

// The [T, H] rows a snapshot write stores to: bank row `slot` of every token.
TensorRef snapshot_rows(const TensorRef& bank, int64_t slot);

}  // namespace attnres::detail
