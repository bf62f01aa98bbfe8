// Rollback: the state after the recorded tokens rows[0..n-1] (a chain prefix
// or a tree path, root first), replaying S = fma(k, delta, g S) from state0:
// the same operations, in the same order, as the forward kernels, so the
// replayed state is bit-identical to the one the forward reached.
// One thread per state element; no q, no output, no SIMD traffic.
// Template: Dk, Dv, Hk, Hv, InT (dtype of k), StT (state dtype).
// Inputs:  state0 [B, Hv, Dv, Dk] (StT); k [B, T, Hk, Dk]; g [B, T, Hv];
//          delta [B, T, Hv, Dv] (float); rows [n] (int); n (int); T (int).
// Output:  state [B, Hv, Dv, Dk] (StT).
const uint i = thread_position_in_grid.x;
const uint dv = thread_position_in_grid.y;
const uint nh = thread_position_in_grid.z;
if (i >= Dk) {
  return;
}
const uint b = nh / Hv;
const uint hv = nh % Hv;
const uint hk = hv / (Hv / Hk);
const uint at = (nh * Dv + dv) * Dk + i;
float s = static_cast<float>(state0[at]);
for (int r = 0; r < n; ++r) {
  const int t = rows[r];
  const float gt = static_cast<float>(g[(b * T + t) * Hv + hv]);
  const float kt = static_cast<float>(k[((b * T + t) * Hk + hk) * Dk + i]);
  s = fma(kt, static_cast<float>(delta[((b * T + t) * Hv + hv) * Dv + dv]), s * gt);
}
state[at] = static_cast<StT>(s);
