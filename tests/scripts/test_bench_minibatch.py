"""scripts/bench_minibatch.py's cells: the experiment as it is, and split into mini-batches that
divide its rollout batch (else a clear error)."""
import pytest

import bench_minibatch


def test_cells_split_the_experiments_rollout_batch():
    # chain_cpu: 12 prompts x 4 answers = 48 samples a step
    assert bench_minibatch.cells("chain_cpu", 16) == {
        "one step per batch": ["+experiment=chain_cpu"],
        "3 mini-batches": ["+experiment=chain_cpu", "trainer.mini_batch_size=16"]}
    with pytest.raises(SystemExit, match="does not divide chain_cpu's 48 samples"):
        bench_minibatch.cells("chain_cpu", 10)
