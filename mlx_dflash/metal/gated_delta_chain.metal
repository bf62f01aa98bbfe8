// Gated delta rule over a block of T tokens, optionally recording the rollback tape.
// Body for mx.fast.metal_kernel. One SIMD group (32 lanes) per
// (batch * value head, value row dv); lane l owns key columns l, l+32, ...
// Threadgroups of (32, 4, 1): four value rows of one head share q and k.
// Template: InT (input dtype), StT (state dtype), Dk, Dv, Hk, Hv, Record (bool).
// Inputs:  q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
//          state_in [B, Hv, Dv, Dk] (StT); T (int); mask [B, T] (bool,
//          all true when there is no padding: a kernel body cannot name an
//          input that is not bound).
// Outputs: y [B, T, Hv, Dv] (InT); state_out [B, Hv, Dv, Dk] (StT);
//          delta [B, T, Hv, Dv] (float): the tape, 0 for masked tokens;
//          written only when Record (otherwise a 1-element placeholder).
// Per token: S = g S; delta = beta (v - S k); S = fma(k, delta, S); y = S q.
// The state update is the same explicit fma as gated_delta_rollback.metal, so a
// replayed state is bit-identical to the forward's.
// Pointers are `auto`: MLX binds an input below 8 elements as `constant`.
constexpr int NPL = (Dk + 31) / 32;
const uint lane = thread_index_in_simdgroup;
const uint dv = thread_position_in_grid.y;
const uint n = thread_position_in_grid.z;
const uint b = n / Hv;
const uint hv = n % Hv;
const uint hk = hv / (Hv / Hk);

float s[NPL];
auto s_in = state_in + (n * Dv + dv) * Dk;
for (int j = 0; j < NPL; ++j) {
  const uint i = lane + 32 * j;
  s[j] = i < Dk ? static_cast<float>(s_in[i]) : 0.0f;
}
for (int t = 0; t < T; ++t) {
  const uint qk = ((b * T + t) * Hk + hk) * Dk;
  const uint vo = ((b * T + t) * Hv + hv) * Dv + dv;
  const uint gb = (b * T + t) * Hv + hv;
  if (!mask[b * T + t]) {  // uniform across the SIMD group: same (b, t)
    if (lane == 0) {
      y[vo] = static_cast<InT>(0.0f);
      if (Record) {
        delta[vo] = 0.0f;
      }
    }
    continue;
  }
  const float gt = static_cast<float>(g[gb]);
  float kv = 0.0f;
  for (int j = 0; j < NPL; ++j) {
    const uint i = lane + 32 * j;
    if (i < Dk) {
      s[j] = s[j] * gt;
      kv += s[j] * static_cast<float>(k[qk + i]);
    }
  }
  kv = simd_sum(kv);
  const float d = (static_cast<float>(v[vo]) - kv) * static_cast<float>(beta[gb]);
  float out = 0.0f;
  for (int j = 0; j < NPL; ++j) {
    const uint i = lane + 32 * j;
    if (i < Dk) {
      s[j] = fma(static_cast<float>(k[qk + i]), d, s[j]);
      out += s[j] * static_cast<float>(q[qk + i]);
    }
  }
  out = simd_sum(out);
  if (lane == 0) {
    y[vo] = static_cast<InT>(out);
    if (Record) {
      delta[vo] = d;
    }
  }
}
auto s_out = state_out + (n * Dv + dv) * Dk;
for (int j = 0; j < NPL; ++j) {
  const uint i = lane + 32 * j;
  if (i < Dk) {
    s_out[i] = static_cast<StT>(s[j]);
  }
}
