// CPU probe: the peak rate of 512-bit `vpdpbusd` on one core (docs/status.md, thirty-seventh session), the bound
// of the byte-tile products (crates/megagemma-model/src/gguf/byte_tiles.rs) once weights come from cache: twelve
// independent accumulator chains, so latency does not limit it. The products' own rate is
// `verify_cost MODEL 1 4 kernels` (single-thread time per matrix) against their `vpdpbusd` count
// (rows / 16 · cols / 32 tile blocks × 8 steps × 3 planes × tokens).
// Build and run: gcc -O2 -mavx512f -mavx512bw -mavx512vnni -o /tmp/vnni tools/probes/vnni_peak.c && /tmp/vnni
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define DECL(i) __m512i a##i = _mm512_set1_epi32(i);
#define STEP(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
#define SUM(i) acc += _mm512_reduce_add_epi32(a##i);

int main(void) {
  DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5) DECL(6) DECL(7) DECL(8) DECL(9) DECL(10) DECL(11)
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi32(0x01020304);
  const long n = 400000000 / 12;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long k = 0; k < n; k++) {
    STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)
    __asm__ volatile("" : "+v"(w));  // keeps the loop from being folded
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  int acc = 0;
  SUM(0) SUM(1) SUM(2) SUM(3) SUM(4) SUM(5) SUM(6) SUM(7) SUM(8) SUM(9) SUM(10) SUM(11)
  printf("%.3f ns per 512-bit vpdpbusd on one core (checksum %d)\n", s * 1e9 / (n * 12.0), acc);
  return 0;
}
