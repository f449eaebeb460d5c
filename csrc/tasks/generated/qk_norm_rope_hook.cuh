// Hand-written forwarder (not generated): includes the build's generated qk_norm_rope body.
// qkv_prep.cuh lives in csrc/tasks, so its own `#include "generated/qk_norm_rope.cuh"` would always find
// csrc/tasks/generated/qk_norm_rope.cuh first (a quoted include searches the including file's folder
// before the -I path). From this folder, "generated/qk_norm_rope.cuh" is not found next to the includer,
// so it resolves on the include path: the build's per-µGraph folder (mpk_dist.runtime.superopt_tasks puts
// it first), else csrc/tasks -> the checked-in body, rendered from qk_norm_rope.ugraph.json beside it (a verified
// µGraph at qwen3-8b's shapes, H=32 D=128; tests/runtime/test_superopt_tasks.py checks the text). The build's
// cache key (runtime.build.included_headers) resolves includes the same way.
#pragma once
#include "generated/qk_norm_rope.cuh"
