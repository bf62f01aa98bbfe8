// Rollback: the state after the recorded tokens rows[0..n-1] (a chain prefix
// or a tree path, root first), replaying S = g S + delta k^T from state0.
// One thread per state element; no q, no output, no SIMD traffic.
// Template: Dk, Dv, Hk, Hv, InT (dtype of k).
// Inputs:  state0 [B, Hv, Dv, Dk] (float); k [B, T, Hk, Dk]; g [B, T, Hv];
//          delta [B, T, Hv, Dv] (float); rows [n] (int); n (int); T (int).
// Output:  state [B, Hv, Dv, Dk] (float).
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
float s = state0[at];
for (int r = 0; r < n; ++r) {
  const int t = rows[r];
  const float gt = static_cast<float>(g[(b * T + t) * Hv + hv]);
  const float kt = static_cast<float>(k[((b * T + t) * Hk + hk) * Dk + i]);
  s = s * gt + kt * delta[((b * T + t) * Hv + hv) * Dv + dv];
}
state[at] = s;
