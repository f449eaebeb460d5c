// Hand-written forwarder (not generated): includes the build's generated qk_norm_rope body.
// qkv_prep.cuh lives in csrc/tasks, so its own `#include "generated/qk_norm_rope.cuh"` would always find
// csrc/tasks/generated/qk_norm_rope.cuh first (a quoted include searches the including file's folder
// before the -I path). From this folder, "generated/qk_norm_rope.cuh" is not found next to the includer,
// so it resolves on the include path: the build's per-µGraph folder (mpk_dist.runtime.superopt_tasks puts
// it first), else csrc/tasks -> the checked-in body rendered at the CLI's default shapes. The build's
// cache key (runtime.build.included_headers) resolves includes the same way.
#pragma once
#include "generated/qk_norm_rope.cuh"
