"""The op graph of ONE tensor-parallel rank: tensors, ops, weight references.

Every backend (torch reference, task-graph compiler + interpreter, mega-kernel) consumes the same
graph. See ``mpk_dist.graph.ops`` for the op kinds and their exact semantics.
"""

from mpk_dist.graph.graph import Graph, Op, TensorSpec, WeightRef, WeightSlice
from mpk_dist.graph.ops import OP_KINDS, OpKind

__all__ = ["Graph", "Op", "TensorSpec", "WeightRef", "WeightSlice", "OP_KINDS", "OpKind"]
