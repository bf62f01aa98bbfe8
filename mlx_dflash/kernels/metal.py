"""Metal launch machinery, shared by every op family and knowing none.

A family describes each kernel call as a :class:`Launch` (inputs, template,
grid), used both by the real dispatch (:func:`run_metal`) and by the CPU
test harness that executes the Metal sources on Linux
(tests/metal_harness.py). The sources are ``mlx_dflash/metal/*.metal``.
The Metal kernel runs when ``mx.metal.is_available()`` and the default
device is the GPU (:func:`use_metal`), decided at call time. A custom Metal
kernel has no VJP in MLX, so every Metal call goes through
:func:`run_with_twin_vjp`, whose VJP is the twin's the family hands it:
training and anything else differentiated through the target work on the
GPU path too.
"""

from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Callable, List, Tuple

import mlx.core as mx

METAL_DIR = Path(__file__).parent.parent / "metal"  # mlx_dflash/metal


@dataclass
class Launch:
    """One mx.fast.metal_kernel call: what to bind and how many threads."""

    name: str  # metal/<name>.metal
    inputs: List[Tuple[str, object]]  # (name, mx.array or python scalar)
    outputs: List[Tuple[str, Tuple[int, ...], mx.Dtype]]
    template: List[Tuple[str, object]]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]


def metal_source(name: str) -> str:
    return (METAL_DIR / f"{name}.metal").read_text()


def use_metal(force_twin: bool = False) -> bool:
    return (not force_twin) and mx.metal.is_available() and mx.default_device() == mx.gpu


@cache
def _compiled(name: str, inputs: Tuple[str, ...], outputs: Tuple[str, ...]):
    return mx.fast.metal_kernel(
        name=f"dflash_{name}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=metal_source(name),
    )


def run_metal(launch: Launch) -> List[mx.array]:
    kern = _compiled(launch.name, tuple(n for n, _ in launch.inputs), tuple(n for n, _, _ in launch.outputs))
    return kern(
        inputs=[a for _, a in launch.inputs],
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[s for _, s, _ in launch.outputs],
        output_dtypes=[d for _, _, d in launch.outputs],
    )


@lru_cache(maxsize=64)
def _with_twin_vjp(launch: Callable, twin: Callable, static: tuple, n_diff: int, n_out: int):
    """The Metal call ``launch`` describes as an mx.custom_function whose VJP
    is ``twin``'s; the first ``n_diff`` arguments are differentiable, the rest
    (a mask) are not. Cached: making one costs more than calling it."""

    @mx.custom_function
    def f(*xs):
        return tuple(run_metal(launch(static, *xs))[:n_out])

    @f.vjp
    def f_vjp(xs, cotangents, outputs):
        cot = list(cotangents) if isinstance(cotangents, (list, tuple)) else [cotangents]
        rest = list(xs[n_diff:])
        grads = mx.vjp(lambda *a: twin(static, *a, *rest), list(xs[:n_diff]), cot)[1]
        return tuple(grads) + tuple(mx.zeros_like(x) for x in rest)

    return f


def run_with_twin_vjp(
    launch: Callable, twin: Callable, static: tuple, primals: tuple, extra: tuple = (), n_out: int = 1
) -> List[mx.array]:
    """Run the Metal kernel ``launch(static, *arrays)`` describes (its first
    ``n_out`` outputs); differentiate through ``twin(static, *arrays)``, the
    same op's MLX body, which returns those outputs.

    MLX has no VJP for a custom kernel (``[Primitive::vjp] Not implemented for
    CustomKernel``), as mlx-lm avoids by using its ops path when training. Here
    the forward stays the kernel and the gradient is the twin's, at the same
    inputs: ``nn.value_and_grad`` through the target works on a Mac GPU.
    ``static``: the call's Python arguments (hashable); ``extra``: arrays with
    no gradient. ``launch`` and ``twin`` are module-level functions of the
    family, so the wrapper is made once per call shape.
    """
    return list(_with_twin_vjp(launch, twin, static, len(primals), n_out)(*primals, *extra))
