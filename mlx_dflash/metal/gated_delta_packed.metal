// Gated delta rule over a block, packed layout for long blocks (prefill) at
// Dk = 128, the layout of mlx-lm's packed prefill kernel: four lanes per value
// row, eight rows per SIMD group, each lane keeps Dk/4 contiguous state
// columns in registers; a row's dot products are reduced over its four lanes
// with two shuffles instead of two full-SIMD reductions.
// Template: InT, StT, Dk (multiple of 4), Dv (multiple of 8), Hk, Hv, Record.
// Grid (32, Dv / 8, B * Hv), threadgroups (32, 2, 1).
// Inputs, outputs and the per-token update as in gated_delta_chain.metal
// (same explicit fma, so gated_delta_rollback.metal replays it bit-identically).
constexpr int VPL = Dk / 4;  // state columns per lane
constexpr int NP = VPL / 4;  // partial sums per lane, four products each
const uint lane = thread_index_in_simdgroup;
const uint sub = lane & 3u;  // lane within its row's four
const uint dv = thread_position_in_grid.y * 8 + lane / 4;
const uint n = thread_position_in_grid.z;
const uint b = n / Hv;
const uint hv = n % Hv;
const uint hk = hv / (Hv / Hk);

float s[VPL];
auto s_in = state_in + (n * Dv + dv) * Dk + sub * VPL;
for (int e = 0; e < VPL; ++e) {
  s[e] = static_cast<float>(s_in[e]);
}
for (int t = 0; t < T; ++t) {
  const uint qk = ((b * T + t) * Hk + hk) * Dk + sub * VPL;
  const uint vo = ((b * T + t) * Hv + hv) * Dv + dv;
  const uint gb = (b * T + t) * Hv + hv;
  if (!mask[b * T + t]) {  // uniform across the SIMD group: same (b, t)
    if (sub == 0) {
      y[vo] = static_cast<InT>(0.0f);
      if (Record) {
        delta[vo] = 0.0f;
      }
    }
    continue;
  }
  const float gt = static_cast<float>(g[gb]);
  float part[NP];
  for (int p = 0; p < NP; ++p) {
    float acc = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const int e = 4 * p + i;
      s[e] = s[e] * gt;
      acc += s[e] * static_cast<float>(k[qk + e]);
    }
    part[p] = acc;
  }
  float kv = 0.0f;
  for (int p = 0; p < NP; ++p) {
    kv += part[p];
  }
  kv += simd_shuffle_xor(kv, 1);
  kv += simd_shuffle_xor(kv, 2);
  const float d = (static_cast<float>(v[vo]) - kv) * static_cast<float>(beta[gb]);
  for (int p = 0; p < NP; ++p) {
    float acc = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const int e = 4 * p + i;
      s[e] = fma(static_cast<float>(k[qk + e]), d, s[e]);
      acc += s[e] * static_cast<float>(q[qk + e]);
    }
    part[p] = acc;
  }
  float out = 0.0f;
  for (int p = 0; p < NP; ++p) {
    out += part[p];
  }
  out += simd_shuffle_xor(out, 1);
  out += simd_shuffle_xor(out, 2);
  if (sub == 0) {
    y[vo] = static_cast<InT>(out);
    if (Record) {
      delta[vo] = d;
    }
  }
}
auto s_out = state_out + (n * Dv + dv) * Dk + sub * VPL;
for (int e = 0; e < VPL; ++e) {
  s_out[e] = static_cast<StT>(s[e]);
}
