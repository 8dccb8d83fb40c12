"""Node health memory across jobs, with a simulated fleet where a restarted job is offered the bad node again."""

from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.schema import JobTopology, KernelEvent
from faultlens.stream.topology import Topology

XID48 = ("NVRM: Xid (PCI:0000:19:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) "
         "has been detected on GPU in the framebuffer at physAddr 0x12bac1c3e0 partition 2, subpartition 1.")


class Fleet:
    """A scheduler that hands a job the first free nodes, asking node health which are admissible."""

    def __init__(self, nodes, health):
        self.nodes, self.health, self.refusals = list(nodes), health, {}

    def place(self, job, count):
        ok, refused = self.health.admissible(self.nodes)
        self.refusals.update(refused)
        chosen = ok[:count]
        topo = Topology(tp=8, pp=1, dp=count, placement={r: (chosen[r // 8], r % 8) for r in range(8 * count)}, job=job)
        return JobTopology(ts=0.0, job=job, **{k: v for k, v in topo.to_job_dict().items() if k != "job"})


def test_restarted_job_is_not_placed_on_the_quarantined_node(tmp_path):
    health = NodeHealth(tmp_path / "health.duckdb")
    fleet = Fleet([f"g{i:02d}" for i in range(6)], health)
    job = fleet.place("train-1", 4)
    assert "g02" in {v["node"] for v in job.ranks.values()}
    _, actions = diagnose_records(job, [KernelEvent(ts=100.0, node="g02", kind="xid", raw=XID48, xid=48)], Config(),
                                  node_health=health)
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["g02"])]
    health.close()

    health = NodeHealth(tmp_path / "health.duckdb")  # the memory outlives the job and the process
    fleet.health = health
    restarted = fleet.place("train-1-restart", 4)
    assert "g02" not in {v["node"] for v in restarted.ranks.values()}
    assert "quarantined by incident" in fleet.refusals["g02"]
    assert set(health.quarantined()) == {"g02"}


def test_quarantine_ends_only_after_verified_recovery():
    health = NodeHealth()
    health.record_eviction("g01", incident_id="inc-1", job="j", kind="ecc_uncorrectable", ts=1.0)
    health.record_diagnostics("g01", passed=False, detail="EUD memory test failed", ts=2.0)
    assert health.admissible(["g01", "g02"])[0] == ["g02"]
    health.record_diagnostics("g01", passed=True, detail="EUD passed", ts=3.0)
    assert health.admissible(["g01", "g02"]) == (["g01", "g02"], {})
    health.record_eviction("g03", incident_id="inc-2", job="j", kind="gpu_lost", ts=4.0)
    health.clear("g03", by="alice", detail="GPU reseated", ts=5.0)
    assert health.quarantined() == {}
    assert [e["event"] for e in health.history("g01")] == ["evicted", "diagnostics_failed", "diagnostics_passed"]


def test_repeat_offender_becomes_rma_candidate():
    health = NodeHealth(rma_after=3)
    for i in range(3):
        health.record_eviction("g07", incident_id=f"inc-{i}", job=f"j{i}", kind="ecc_uncorrectable", ts=float(i))
        health.record_diagnostics("g07", passed=True, ts=i + 0.5)
    assert health.rma_candidates() == ["g07"]
