"""The operator graph: IR, tracer, op registry and repeated-block detection."""

from flexsearch.graph.opgraph import BlockGroup, OpGraph, OpNode, ParallelDims, TensorMeta
from flexsearch.graph.tracer import trace

__all__ = ["BlockGroup", "OpGraph", "OpNode", "ParallelDims", "TensorMeta", "trace"]
