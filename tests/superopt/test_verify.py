"""Verification: >= 200 wrong µGraphs (mutants of found ones) are all rejected; the found ones
pass both the finite-field test and the float32 check against torch."""

import numpy as np
import pytest

from mpk_dist.superopt.field import FloatAlgebra
from mpk_dist.superopt.interp import run_float, run_graph
from mpk_dist.superopt.mutate import mutants
from mpk_dist.superopt.verify import float_inputs, torch_reference, verify, verify_field

PATTERNS = ("rmsnorm_linear", "silu_mul_linear", "attention_decode")


def _is_wrong(ug, g) -> bool:
    """Independent judgement: does the mutant differ from the target in float64?"""
    feeds = {k: v.astype(np.float64) for k, v in float_inputs(g, seed=7).items()}
    ref = run_graph(FloatAlgebra(), g, feeds)
    try:
        out = run_float(ug, feeds)[0]
    except Exception:  # noqa: BLE001 (a mutant that cannot even run is wrong)
        return True
    return out.shape != ref.shape or not np.allclose(out, ref, rtol=1e-6, atol=1e-9)


def test_found_graphs_are_correct_against_torch(results):
    for name in PATTERNS:
        g, res = results(name)
        assert res.candidates, name
        for ug in res.candidates:
            assert verify(ug, g), name
            feeds = float_inputs(g, seed=11)
            ref = torch_reference(g, feeds)
            assert np.allclose(run_float(ug, feeds, np.float32)[0], ref, rtol=2e-3,
                               atol=2e-3 * np.abs(ref).max())


def test_at_least_200_wrong_mutants_all_rejected(results):
    wrong, equivalent, kinds = 0, 0, set()
    for name in PATTERNS:
        g, res = results(name)
        top = 2 if name == "attention_decode" else 3  # attention mutants emulate 128+ blocks
        for ug in res.candidates[:top]:
            for desc, m in mutants(ug):
                if _is_wrong(m, g):
                    wrong += 1
                    kinds.add(desc.split(":")[1].split()[0])
                    assert not verify_field(m, g, trials=3, seed=5), f"{name}: {desc}\n{m}"
                else:
                    equivalent += 1
                    assert verify_field(m, g, trials=3, seed=5), f"{name}: {desc} (equivalent)"
    assert wrong >= 200, (wrong, equivalent)
    # every mutation family the issue names is represented
    assert {"imap", "fmap", "omap", "swap", "drop", "acc"} <= kinds, kinds


@pytest.mark.parametrize("trials", [3, 5])
def test_each_trial_draws_fresh_inputs(results, trials):
    g, res = results("silu_mul_linear")
    assert verify_field(res.best, g, trials=trials, seed=trials)
