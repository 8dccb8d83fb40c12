"""The real training job on a real Slurm cluster loses a machine and trains again, nobody involved (issue 34).

benchmarks/torchjob/slurmjob.py: LocalSlurm's four slurmd, ``sbatch --requeue -N 3`` of the torch
job (srun -> one torchrun per node), one ``faultlens agent`` per Slurm node, the embedded broker,
stream processor, online diagnosis and ``faultlens runner --adapter slurm --execute``. The fault is
the one realjob.py makes for a lost machine: an Xid 79 line in that node's kernel log and a
SIGKILLed rank. What is asserted is what Slurm and the job's own files then say. ~50 s on 2 cores at
load 6, ~95 s at load 10 (torch's start dominates).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import sys
import time
from pathlib import Path

import pytest

from faultlens.datasets.slurm_local import unavailable_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.broker,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed (the [torch] extra; `make test` installs the CPU wheel)"),
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


@pytest.mark.timeout(360)
def test_a_lost_machine_is_drained_and_the_requeued_job_trains_on_the_healthy_nodes(tmp_path) -> None:
    from benchmarks.torchjob.slurmjob import SlurmJobCluster

    c = SlurmJobCluster(tmp_path / "run", ckpt_every=5)
    c.start()
    try:
        job = c.submit()
        warm = c.wait_training(since=0, min_step=7, timeout_s=180)
        assert warm is not None, (c.workdir / f"slurm-{job}.out").read_text()[-2000:]
        first = c.running_nodes()
        assert len(first) == 3
        victim = first[1]
        t_fault = time.time()
        c.lose_machine(victim)
        back = None
        while time.time() - t_fault < 150 and back is None:  # torch starting under load: ~20 s at load 6, 60+ at 30
            fields = c.job_fields()
            if int(fields.get("Restarts", 0)) >= 1 and fields.get("JobState") == "RUNNING":
                back = c.last_step(since=t_fault + 1)
            time.sleep(0.5)
        assert back is not None, f"not training again: {c.job_fields()}; drained: {c.drained()}"
        # Slurm's word: the node drained with faultlens's incident id, the job requeued once, without it.
        reason = c.drained().get(victim, "")
        assert re.match(r"faultlens inc-\w+: .*gpu_lost", reason), reason
        fields = c.job_fields()
        assert fields["Restarts"] == "1" and victim not in c.running_nodes() and len(c.running_nodes()) == 3
        # The runner's ledger: one evict_nodes, carried out through Slurm (drain, requeue), done.
        ledger = [json.loads(line) for line in (c.workdir / "runner-ledger.jsonl").read_text().splitlines()]
        assert {e.get("step") for e in ledger} >= {f"drain:{victim}", f"requeue:{job}"}
        assert [e["status"] for e in ledger if "status" in e][-1] == "done"
        # The second attempt resumed from a checkpoint (every 5 steps: it starts at 5k + 1), not from step 0.
        # Its first step is where rank 0's steps go back, or resume after the restart's gap (a checkpoint
        # taken at the very step the fault came after resumes at the next step number).
        recs = c.step_records()
        restarts = [b["step"] for a, b in itertools.pairwise(recs)
                    if b["ts"] > t_fault and (b["step"] <= a["step"] or b["ts"] - a["ts"] > 5.0)]
        assert restarts and restarts[0] >= 6 and restarts[0] % 5 == 1, restarts
    finally:
        c.stop()
    assert c.slurm.job_pids() == [], "a process of the cluster or the job was left running"
    assert c.rank_pids(victim) == []
