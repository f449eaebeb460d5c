"""The superoptimizer: µGraph search with abstract-expression pruning and finite-field checks.

``Graph`` describes a target computation; ``superoptimize(g, ...)`` enumerates µGraphs (kernel
graph, block graphs, thread-level chains), prunes prefixes whose abstract expression is not a
subexpression of the target's (z3), verifies complete graphs by random tests over finite fields
and a float32 check against torch, and ranks them by a cost model. See docs/SUPEROPT.md.
z3 and torch are imported only when a search or a float check runs.
"""

from mpk_dist.superopt.graph import Graph, GraphError, Tensor
from mpk_dist.superopt.search import SearchResult, superoptimize
from mpk_dist.superopt.ugraph import BlockGraph, KernelOp, UGraph

__all__ = ["Graph", "GraphError", "Tensor", "superoptimize", "SearchResult", "UGraph",
           "KernelOp", "BlockGraph"]
