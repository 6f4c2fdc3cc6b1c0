#include "cpu/bf16.hpp"

#if defined(__x86_64__) || defined(_M_X64) || defined(__SSE__)
#include <xmmintrin.h>
#define ATTNRES_X86_MXCSR 1
#endif

namespace attnres::detail {

#if defined(ATTNRES_X86_MXCSR)
// MXCSR bit 15 = flush-to-zero, bit 6 = denormals-are-zero.
KeepSubnormals::KeepSubnormals() : saved_(_mm_getcsr()) {
  _mm_setcsr(static_cast<unsigned>(saved_) & ~0x8040u);
}
KeepSubnormals::~KeepSubnormals() { _mm_setcsr(static_cast<unsigned>(saved_)); }
#elif defined(__aarch64__)
// FPCR bit 24 = flush-to-zero.
KeepSubnormals::KeepSubnormals() {
  uint64_t fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  saved_ = fpcr;
  fpcr &= ~(uint64_t{1} << 24);
  __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
}
KeepSubnormals::~KeepSubnormals() { __asm__ volatile("msr fpcr, %0" : : "r"(saved_)); }
#else
KeepSubnormals::KeepSubnormals() {}
KeepSubnormals::~KeepSubnormals() {}
#endif

}  // namespace attnres::detail
