"""The shared-memory transport (``init_mesh(transport="shm")``, shardlib.parallel.shm): its collectives equal the
process group's, a sharded model over it equals the unsharded model (the BERT hypothesis property, drawn again
over shared memory), a missing rank ends the wait with its name, and bad requests are refused clearly."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rank_tasks
import shm_tasks
from strategies import bert_specs

#: the BERT property already runs its full budget over gloo (test_bert_equivalence); over shared memory an eighth
#: of it searches the transport's own cases (sizes against the slot, tp=2 and 4, SP kinds)
EXAMPLES = max(10, settings().max_examples // 8)


@settings(max_examples=EXAMPLES)
@given(tp=st.sampled_from([2, 4]), shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data(),
       dtype=st.sampled_from(["float32", "float64", "bfloat16"]), seed=st.integers(0, 2**16),
       slot_bytes=st.sampled_from([64, 1 << 20]))
def test_collectives_match_the_process_group(pool, tp, shape, data, dtype, seed, slot_bytes):
    dim = data.draw(st.integers(0, len(shape) - 1))
    spec = {"tp": tp, "shape": shape, "dim": dim, "dtype": dtype, "seed": seed, "slot_bytes": slot_bytes}
    assert all(n == 7 for n in pool.run(shm_tasks.collectives_match_the_process_group, spec))


@settings(max_examples=EXAMPLES)
@given(spec=bert_specs(tp=(2, 4), all_to_all=True))
def test_sharded_bert_over_shared_memory_matches_unsharded(pool, spec):
    for compared in pool.run(rank_tasks.equivalence, {**spec, "transport": "shm"}):
        assert compared["outputs"] >= 1 and compared["grads"] >= 1 and compared["weights"] >= compared["grads"]


def test_a_rank_that_never_arrives_is_named(pool):
    results = pool.run(shm_tasks.late_rank_is_named, {"timeout_s": 2})
    assert results[1] == "skipped"
    assert "ranks [1] of the group did not arrive within 2 s" in results[0]


def test_the_default_transport_attaches_where_it_can(pool):
    for rank, got in enumerate(pool.run(shm_tasks.default_transport_decisions, {})):
        assert got["default"] == ("shm", True), (rank, got)
        assert got["other hosts, default"] == got["no room, default"] == ("c10d", False), (rank, got)
        assert "needs every rank of a group on one host" in got["other hosts, shm"] and "spans 2 hosts" in \
            got["other hosts, shm"], (rank, got)
        assert "/dev/shm has no room for group" in got["no room, shm"] and "MiB" in got["no room, shm"], (rank, got)


def test_bad_transport_is_refused():
    import shardlib

    with pytest.raises(shardlib.MeshError, match="transport='tcp'"):
        shardlib.init_mesh(tp=1, transport="tcp")


def test_a_dead_peer_ends_the_wait_at_once(tmp_path):
    """Two fresh processes (not the pool: a rank dies): the survivor's wait ends within seconds, not the 60 s
    timeout, naming the dead rank."""
    import torch.multiprocessing as mp

    out = tmp_path / "out.txt"
    mp.start_processes(shm_tasks.dead_peer_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2,
                       start_method="spawn")
    seconds, message = out.read_text().split("\n", 1)
    assert message == "shared-memory collective 1: the process of rank(s) [1] of the group is gone"
    assert float(seconds) < 10
