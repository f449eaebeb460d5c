"""mpk_dist: a multi-GPU LLM decoding runtime.

Each tensor-parallel shard of a model is compiled into one persistent GPU kernel (a task graph run
by an in-kernel runtime). This package holds the model front end (config, weights, op graph), the
torch reference backend, the task-graph compiler, the CPU interpreter, the CUDA runtime, the
superoptimizer and the launch tooling. See docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
