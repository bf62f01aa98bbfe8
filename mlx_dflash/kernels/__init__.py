"""Ops by family, each with an MLX twin (the reference, every backend) and,
where one exists, a Metal kernel its dispatcher picks at call time:

- :mod:`.gated_delta`: the gated delta rule (chain, tree, single step,
  stepwise), its rollback from a recorded tape, and their Metal launches;
- :mod:`.conv`: depthwise causal conv1d + SiLU, tree windows, conv rollback;
- :mod:`.fused_exp`: the CPU's fused exp, sigmoid, SiLU and attention, and
  when a forward uses them;
- :mod:`.metal`: the Metal launch machinery and the twin-VJP wrapper, which
  knows no family: each family hands it its own launch and twin.

Tree topology (ancestor matrix, preorder, path rows) lives in ``ddtree``.
"""
