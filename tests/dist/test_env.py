"""Rank detection, GPU selection and the one-node TP group check, from hand-written environments."""

import pytest

from mpk_dist.dist.env import (
    RankInfo,
    check_tp_group_on_one_node,
    launched_by_mpi,
    rank_info,
    rank_info_from_env,
    select_device,
    tp_groups_spanning_nodes,
    visible_devices,
)
from mpk_dist.errors import BackendUnavailable, InputError, MpkError


def test_single_process_is_rank_zero_of_one():
    info = rank_info({"PMIX_HOSTNAME": "n1"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (0, 1, 0, 1)
    assert info.node_name == "n1" and info.source == "single"
    assert not launched_by_mpi({"SLURM_PROCID": "3"})


def test_open_mpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        # Values of the Slurm step that started mpirun's daemons: must be ignored.
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
    }
    info = rank_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert info.source == "openmpi"


def test_mpich_hydra_variables():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    info = rank_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert info.source == "pmi"


def test_srun_pmix_uses_step_variables_only_when_procid_matches():
    env = {
        "PMIX_RANK": "3", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    info = rank_info_from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    # Under mpirun-in-allocation without OMPI variables, SLURM_PROCID disagrees: not trusted.
    assert rank_info_from_env({**env, "SLURM_PROCID": "0"}) is None


def test_uneven_tasks_per_node():
    env = {
        "PMIX_RANK": "4", "SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    }
    assert rank_info_from_env(env).local_world_size == 1


def test_malformed_and_impossible_values_are_refused():
    with pytest.raises(InputError, match="OMPI_COMM_WORLD_RANK: expected an integer"):
        rank_info({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(InputError, match="expected 0 <= rank < world_size"):
        rank_info({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"})


def _info(rank, world, local, local_world, node="n0"):
    return RankInfo(rank, world, local, local_world, node)


def test_select_device_one_visible_gpu_per_task():
    # srun --gpus-per-task=1: each task sees exactly its own GPU, whatever its local rank.
    assert select_device(_info(3, 4, 3, 4), {"CUDA_VISIBLE_DEVICES": "5"}) == 0


def test_select_device_by_local_rank_with_gres():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert [select_device(_info(r, 8, r % 4, 4), env) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_select_device_shared_gpus_round_robin():
    assert [select_device(_info(r, 4, r, 4), {}, num_devices=2) for r in range(4)] == [0, 1, 0, 1]


def test_select_device_without_gpu_raises():
    with pytest.raises(BackendUnavailable, match="expected at least one visible CUDA device"):
        select_device(_info(0, 2, 0, 2), {"CUDA_VISIBLE_DEVICES": ""})
    # CUDA ignores everything after an invalid entry such as -1.
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]
    assert visible_devices({}) is None


def test_tp_groups_spanning_nodes():
    hosts = ["a", "a", "a", "a", "b", "b", "b", "b"]
    assert tp_groups_spanning_nodes(hosts, 4) == []
    assert tp_groups_spanning_nodes(hosts, 8) == [(0, ["a", "b"])]
    assert tp_groups_spanning_nodes(["a", "a", "a", "b", "b", "b"], 2) == [(1, ["a", "b"])]


def test_check_tp_group_message_names_group_and_hosts():
    info = _info(0, 4, 0, 2, "a")
    check_tp_group_on_one_node(info, 2, hostnames=["a", "a", "b", "b"])
    with pytest.raises(MpkError, match=r"TP group 0 \(ranks 0-3\): expected all 4 ranks on one node, got ranks on a, b"):
        check_tp_group_on_one_node(info, 4, hostnames=["a", "a", "b", "b"])
    with pytest.raises(InputError, match="tp: expected a positive divisor"):
        check_tp_group_on_one_node(info, 3, hostnames=["a"] * 4)


def test_check_tp_group_block_fallback_without_hostnames():
    # No MPI job here, so the check falls back to contiguous per-node blocks.
    check_tp_group_on_one_node(_info(5, 8, 1, 4), 4)
    with pytest.raises(MpkError, match="expected all 8 ranks on one node"):
        check_tp_group_on_one_node(_info(5, 8, 1, 4), 8)
    check_tp_group_on_one_node(_info(0, 1, 0, 1), 8)  # one process holds the whole group
