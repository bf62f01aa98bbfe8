// Depthwise causal conv1d + SiLU over a block, chain or tree.
// out[b, t, c] = silu(sum_j w[c, j] * conv_in[b, idx[t, j], c]): idx holds each
// token's K-row window into concat(conv_state, block), oldest first, gathered
// along the parent chain in tree mode (the sliding window in chain mode), per
// batch row (slots of batched decoding may each have their own tree).
// One thread per output element.
// Template: InT, K, C.
// Inputs:  conv_in [B, R, C] (InT); weight [C, K] (InT); idx [B, T, K] (int); R (int); T (int).
// Output:  out [B, T, C] (InT).
const uint c = thread_position_in_grid.x;
const uint t = thread_position_in_grid.y;
const uint b = thread_position_in_grid.z;
if (c >= C) {
  return;
}
float acc = 0.0f;
for (int j = 0; j < K; ++j) {
  const int row = idx[(b * T + t) * K + j];
  acc += static_cast<float>(weight[c * K + j]) * static_cast<float>(conv_in[(b * R + row) * C + c]);
}
// Round like the MLX twin and mlx-lm (nn.silu in the input dtype): the sum
// rounded to InT, sigmoid rounded to InT, then their product rounded to InT.
const InT x = static_cast<InT>(acc);
const float xf = static_cast<float>(x);
const InT sig = static_cast<InT>(1.0f / (1.0f + exp(-xf)));
out[(b * T + t) * C + c] = static_cast<InT>(xf * static_cast<float>(sig));
