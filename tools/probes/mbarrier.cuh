// Shared pieces of the probes that use mbarriers (cluster_exchange.cu, loader_ring.cu; each stays
// one `nvcc FILE.cu` program): %globaltimer, and init / expect-tx / try-wait on a shared-memory
// mbarrier at shared address `a`.
#pragma once

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void mbar_init(unsigned a, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
}
// One arrival that also expects `bytes` of asynchronous copies to complete on the barrier.
__device__ __forceinline__ void mbar_expect(unsigned a, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
// Whether the phase of the given parity has completed (acquire at cluster scope: also what other
// blocks of a cluster wrote into this block's shared memory before completing it).
__device__ __forceinline__ bool mbar_done(unsigned a, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok)
      : "r"(a), "r"(parity)
      : "memory");
  return ok;
}
