"""Write ``vgg16_pipedream.txt``: a PipeDream-format profile of VGG-16, derived, not measured.

Model: torchvision's VGG-16 (configuration D, no batch norm) on 3x224x224 images,
batch 64, fp32 on one V100. The graph is a chain of 22 nodes:

* ``Input``: the image batch (no compute);
* 13 ``Conv2d`` 3x3/pad 1 layers, each with its ``ReLU`` folded in (fused, in place);
* 5 ``MaxPool2d`` 2x2/stride 2 layers, after conv1_2, conv2_2, conv3_3, conv4_3, conv5_3;
* fc6 (flatten + Linear 25088x4096 + ReLU + Dropout), fc7 (Linear 4096x4096 + ReLU +
  Dropout), fc8 (Linear 4096x1000).

Numbers, per node, for one minibatch (the roofline the brief fixes):

* ``forward_compute_time`` (ms) = max(FLOPs / (15.7e12 * 0.5), bytes / (900e9 * 0.7)) * 1e3:
  V100 fp32 peak 15.7 TFLOP/s at 50% efficiency, or HBM2 900 GB/s at 70% when memory
  bound, whichever is slower. FLOPs = 2 x multiply-accumulates (conv: 2*B*H*W*Cout*Cin*9,
  linear: 2*B*in*out; bias and ReLU not counted); max pooling counts 3 comparisons per
  output element. bytes = fp32 input + output + parameters, each moved once.
* ``backward_compute_time`` = 2 x forward (input gradient + weight gradient).
* ``activation_size`` = bytes of the node's output tensor (fp32, batch 64).
* ``parameter_size`` = bytes of the node's weights and biases (fp32); their sum is
  138,357,544 parameters x 4 bytes, VGG-16's published count.

Times are rounded to 4 decimals (0.1 microsecond). Run ``python
benchmarks/profiles/make_vgg16_profile.py`` to rewrite the file; the tests check that the
shipped file equals this script's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flexsearch.graph.pipedream_profile import ProfileGraph, ProfileNode, format_profile

PEAK_FLOPS = 15.7e12  # V100 fp32 (SXM2), FLOP/s
COMPUTE_EFFICIENCY = 0.5
PEAK_BANDWIDTH = 900e9  # V100 HBM2, bytes/s
BANDWIDTH_EFFICIENCY = 0.7
FP32 = 4  # bytes

# VGG-16 (configuration D): output channels of each conv, "M" for a 2x2 max pool.
CONFIG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip
CLASSIFIER = ((25088, 4096), (4096, 4096), (4096, 1000))

OUTPUT = Path(__file__).resolve().parent / "vgg16_pipedream.txt"


def roofline_ms(flops: float, bytes_moved: float) -> float:
    """Forward time in milliseconds: the slower of the compute and the memory bound."""
    compute_s = flops / (PEAK_FLOPS * COMPUTE_EFFICIENCY)
    memory_s = bytes_moved / (PEAK_BANDWIDTH * BANDWIDTH_EFFICIENCY)
    return max(compute_s, memory_s) * 1e3


def _node(
    index: int, description: str, flops: float, bytes_moved: float, out: int, params: int
) -> ProfileNode:
    forward = round(roofline_ms(flops, bytes_moved), 4)
    return ProfileNode(
        id=f"node{index}",
        description=description,
        forward_ms=forward,
        backward_ms=round(2 * forward, 4),
        activation_bytes=float(out * FP32),
        parameter_bytes=float(params * FP32),
    )


def vgg16_profile(batch: int = 64) -> ProfileGraph:
    """The roofline profile of VGG-16 at ``batch`` 224x224 images, as a chain."""
    channels, size = 3, 224
    nodes = [
        ProfileNode(
            id="node1",
            description="Input0",
            forward_ms=0.0,
            backward_ms=0.0,
            activation_bytes=float(batch * channels * size * size * FP32),
            parameter_bytes=0.0,
        )
    ]
    block, layer = 1, 1
    for entry in CONFIG:
        in_elems = batch * channels * size * size
        if entry == "M":
            size //= 2
            out_elems = batch * channels * size * size
            description = (
                f"pool{block}: MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, "
                "ceil_mode=False)"
            )
            flops = 3.0 * out_elems
            nodes.append(
                _node(
                    len(nodes) + 1, description, flops, FP32 * (in_elems + out_elems), out_elems, 0
                )
            )
            block, layer = block + 1, 1
            continue
        cout = int(entry)
        out_elems = batch * cout * size * size
        params = channels * cout * 9 + cout
        flops = 2.0 * batch * size * size * cout * channels * 9
        description = (
            f"conv{block}_{layer}: Conv2d({channels}, {cout}, kernel_size=(3, 3), stride=(1, 1), "
            "padding=(1, 1)) + ReLU(inplace=True)"
        )
        bytes_moved = FP32 * (in_elems + out_elems + params)
        nodes.append(_node(len(nodes) + 1, description, flops, bytes_moved, out_elems, params))
        channels, layer = cout, layer + 1
    assert channels * size * size == CLASSIFIER[0][0]
    for number, (fan_in, fan_out) in enumerate(CLASSIFIER, start=6):
        params = fan_in * fan_out + fan_out
        flops = 2.0 * batch * fan_in * fan_out
        bytes_moved = FP32 * (batch * fan_in + batch * fan_out + params)
        linear = f"Linear(in_features={fan_in}, out_features={fan_out}, bias=True)"
        if number == 6:
            description = f"fc6: Flatten + {linear} + ReLU(inplace=True) + Dropout(p=0.5)"
        elif number == 7:
            description = f"fc7: {linear} + ReLU(inplace=True) + Dropout(p=0.5)"
        else:
            description = f"fc8: {linear}"
        nodes.append(
            _node(len(nodes) + 1, description, flops, bytes_moved, batch * fan_out, params)
        )
    edges = tuple((nodes[i].id, nodes[i + 1].id) for i in range(len(nodes) - 1))
    return ProfileGraph(nodes=tuple(nodes), edges=edges)


def main(argv: list[str] | None = None) -> int:
    """Write the profile to ``argv[0]`` (default: ``vgg16_pipedream.txt`` next to this file)."""
    argv = sys.argv[1:] if argv is None else argv
    target = Path(argv[0]) if argv else OUTPUT
    graph = vgg16_profile()
    target.write_text(format_profile(graph))
    total_fwd = sum(n.forward_ms for n in graph.nodes)
    total_params = sum(n.parameter_bytes for n in graph.nodes)
    print(
        f"{target}: {len(graph.nodes)} nodes, forward {total_fwd:.3f} ms, parameters {total_params:.0f} bytes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
