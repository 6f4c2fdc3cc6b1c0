// Layout helpers shared by validation and the backends.
#pragma once

#include "attnres/tensor.hpp"

namespace attnres::detail {

// True when no two indices of the view map to the same element (sufficient test: dimensions sorted by
// stride, each stride at least the extent of the smaller ones). Assumes non-negative strides.
bool non_overlapping(const TensorRef& t);

// True when the byte ranges the two views can touch intersect (conservative for interleaved views).
bool overlaps(const TensorRef& a, const TensorRef& b);

// The [T, H] rows a snapshot write stores to: bank row `slot` of every token.
TensorRef snapshot_rows(const TensorRef& bank, int64_t slot);

}  // namespace attnres::detail
