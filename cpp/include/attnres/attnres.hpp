// Umbrella header of the attnres C++ library.
#pragma once

#include "attnres/all_reduce.hpp"
#include "attnres/attn_res.hpp"
#include "attnres/device.hpp"
#include "attnres/error.hpp"
#include "attnres/limits.hpp"
#include "attnres/moe_finalize.hpp"
#include "attnres/tensor.hpp"
#include "attnres/version.hpp"
