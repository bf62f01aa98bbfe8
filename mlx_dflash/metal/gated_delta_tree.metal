// Gated delta rule over a tree of T tokens (tree verify), recording the tape.
// Token t starts from the state after its parent parents[t] (-1: from
// state_in). Same layout and threads as gated_delta_chain.metal; each lane
// keeps the states of all nodes' key columns it owns (parents precede
// children, so a node's parent state is always ready).
// Template: InT, Dk, Dv, Hk, Hv, MaxT (>= T).
// Inputs:  q, k, v, g, beta, state_in as in the chain kernel; parents [T] (int); T (int).
// Outputs: y [B, T, Hv, Dv] (InT); state_out (state after the last node's path);
//          delta [B, T, Hv, Dv] (float).
constexpr int NPL = (Dk + 31) / 32;
const uint lane = thread_index_in_simdgroup;
const uint dv = thread_position_in_grid.y;
const uint n = thread_position_in_grid.z;
const uint b = n / Hv;
const uint hv = n % Hv;
const uint hk = hv / (Hv / Hk);

float s0[NPL];
float nodes[MaxT * NPL];
const device float* s_in = state_in + (n * Dv + dv) * Dk;
for (int j = 0; j < NPL; ++j) {
  const uint i = lane + 32 * j;
  s0[j] = i < Dk ? s_in[i] : 0.0f;
}
for (int t = 0; t < T; ++t) {
  const int p = parents[t];
  const uint qk = ((b * T + t) * Hk + hk) * Dk;
  const uint vo = ((b * T + t) * Hv + hv) * Dv + dv;
  const uint gb = (b * T + t) * Hv + hv;
  const float gt = static_cast<float>(g[gb]);
  float kv = 0.0f;
  for (int j = 0; j < NPL; ++j) {
    const uint i = lane + 32 * j;
    const float prev = p < 0 ? s0[j] : nodes[p * NPL + j];
    nodes[t * NPL + j] = prev * gt;
    if (i < Dk) {
      kv += nodes[t * NPL + j] * static_cast<float>(k[qk + i]);
    }
  }
  kv = simd_sum(kv);
  const float d = (static_cast<float>(v[vo]) - kv) * static_cast<float>(beta[gb]);
  float out = 0.0f;
  for (int j = 0; j < NPL; ++j) {
    const uint i = lane + 32 * j;
    if (i < Dk) {
      nodes[t * NPL + j] = nodes[t * NPL + j] + static_cast<float>(k[qk + i]) * d;
      out += nodes[t * NPL + j] * static_cast<float>(q[qk + i]);
    }
  }
  out = simd_sum(out);
  if (lane == 0) {
    y[vo] = static_cast<InT>(out);
    delta[vo] = d;
  }
}
device float* s_out = state_out + (n * Dv + dv) * Dk;
for (int j = 0; j < NPL; ++j) {
  const uint i = lane + 32 * j;
  if (i < Dk) {
    s_out[i] = nodes[(T - 1) * NPL + j];
  }
}
