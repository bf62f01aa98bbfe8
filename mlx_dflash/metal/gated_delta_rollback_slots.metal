// Rollback of a batch whose rows are slots (batched decoding), each slot
// keeping its own count: slot b's state after its recorded tokens
// rows[b, 0..counts[b]-1] (a chain prefix or a tree path, root first),
// replayed from state0 with the same fma, in the same order, as
// gated_delta_rollback.metal and the forward kernels, so each slot's state
// is bit-identical to the one the forward reached after those rows. Rows
// past a slot's count are never read; a slot keeping its whole block
// (counts[b] >= T) takes the forward's own final state.
// One thread per state element, as gated_delta_rollback.metal.
// Template: Dk, Dv, Hk, Hv, InT (dtype of k), StT (state dtype).
// Inputs:  state0, state_final [B, Hv, Dv, Dk] (StT); k [B, T, Hk, Dk]; g [B, T, Hv];
//          delta [B, T, Hv, Dv] (float); rows [B, R] (int); counts [B] (int);
//          R (int); T (int).
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
const int n = counts[b];
if (n >= T) {
  state[at] = state_final[at];
  return;
}
float s = static_cast<float>(state0[at]);
for (int r = 0; r < n && r < R; ++r) {
  const int t = rows[b * R + r];
  if (t < 0 || t >= T) {  // the host validates; never index out of bounds
    continue;
  }
  const float gt = static_cast<float>(g[(b * T + t) * Hv + hv]);
  const float kt = static_cast<float>(k[((b * T + t) * Hk + hk) * Dk + i]);
  s = fma(kt, static_cast<float>(delta[((b * T + t) * Hv + hv) * Dv + dv]), s * gt);
}
state[at] = static_cast<StT>(s);
