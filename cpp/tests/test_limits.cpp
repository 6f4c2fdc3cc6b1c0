// The limits of attnres/limits.hpp against the code paths that enforce them: a limit restated elsewhere as a
// literal must agree with the named constant the Python layer reads (attnres._C.limits).
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>

#include "attnres/attnres.hpp"

namespace attnres {
namespace {

TEST(Limits, AllReduceWorldSizesAreExactlyTheSupportedWorlds) {
  for (int32_t w = -1; w <= 2 * kAllReduceMaxWorld + 1; ++w) {
    const bool listed = std::find(std::begin(kAllReduceWorldSizes), std::end(kAllReduceWorldSizes), w) !=
                        std::end(kAllReduceWorldSizes);
    EXPECT_EQ(all_reduce_world_supported(w), listed) << "W = " << w;
  }
}

TEST(Limits, TheLargestAllReduceWorldIsTheCommunicatorsCapacity) {
  EXPECT_EQ(kAllReduceWorldSizes[kNumAllReduceWorldSizes - 1], kAllReduceMaxWorld);
  EXPECT_TRUE(std::is_sorted(std::begin(kAllReduceWorldSizes), std::end(kAllReduceWorldSizes)));
}

}  // namespace
}  // namespace attnres
