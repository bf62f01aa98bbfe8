// Gated delta rule over a tree of T tokens (tree verify), recording the tape.
// Token t starts from the state after its parent parents[t] (-1: from
// state_in). Same threads and per-token update as gated_delta_chain.metal.
// Nodes are visited in depth-first preorder (order[], computed and validated
// on the host), so a node's parent state is always the entry one level up of
// a per-thread stack of MaxDepth states: registers bounded by the tree depth
// (at most the draft block), whatever the number of nodes.
// Batch rows may be slots of batched decoding, each with its own tree of T
// nodes: order and depth are per batch row (one tree for all rows: the same
// row repeated).
// Template: InT, StT, Dk, Dv, Hk, Hv, MaxDepth (> deepest depth), Record.
// Inputs:  q, k, v, g, beta, state_in as in the chain kernel; order [B, T]
//          (int, each row's preorder); depth [B, T] (int, 0 for a root,
//          parent's + 1 otherwise); T (int).
// Outputs: y [B, T, Hv, Dv] (InT); state_out (state after the path of node
//          T - 1); delta [B, T, Hv, Dv] (float), written only when Record.
constexpr int NPL = (Dk + 31) / 32;
const uint lane = thread_index_in_simdgroup;
const uint dv = thread_position_in_grid.y;
const uint n = thread_position_in_grid.z;
const uint b = n / Hv;
const uint hv = n % Hv;
const uint hk = hv / (Hv / Hk);

float s0[NPL];
float stack[MaxDepth * NPL];
auto s_in = state_in + (n * Dv + dv) * Dk;
auto s_out = state_out + (n * Dv + dv) * Dk;
for (int j = 0; j < NPL; ++j) {
  const uint i = lane + 32 * j;
  s0[j] = i < Dk ? static_cast<float>(s_in[i]) : 0.0f;
}
for (int r = 0; r < T; ++r) {
  const int t = order[b * T + r];
  const int lvl = t >= 0 && t < T ? depth[b * T + t] : -1;
  if (lvl < 0 || lvl >= MaxDepth) {  // the host validates; never index out of bounds
    continue;
  }
  const uint qk = ((b * T + t) * Hk + hk) * Dk;
  const uint vo = ((b * T + t) * Hv + hv) * Dv + dv;
  const uint gb = (b * T + t) * Hv + hv;
  const float gt = static_cast<float>(g[gb]);
  float kv = 0.0f;
  for (int j = 0; j < NPL; ++j) {
    const uint i = lane + 32 * j;
    const float prev = lvl == 0 ? s0[j] : stack[(lvl - 1) * NPL + j];
    const float sg = prev * gt;
    stack[lvl * NPL + j] = sg;
    if (i < Dk) {
      kv += sg * static_cast<float>(k[qk + i]);
    }
  }
  kv = simd_sum(kv);
  const float d = (static_cast<float>(v[vo]) - kv) * static_cast<float>(beta[gb]);
  float out = 0.0f;
  for (int j = 0; j < NPL; ++j) {
    const uint i = lane + 32 * j;
    if (i < Dk) {
      const float sn = fma(static_cast<float>(k[qk + i]), d, stack[lvl * NPL + j]);
      stack[lvl * NPL + j] = sn;
      out += sn * static_cast<float>(q[qk + i]);
      if (t == T - 1) {
        s_out[i] = static_cast<StT>(sn);
      }
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
