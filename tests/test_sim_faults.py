"""Each fault kind leaves its documented footprint in each signal (and only where documented)."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.faults import FAULTS
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import write_batch_dir

WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=\d+, OpType=(\w+)")
TRACEBACK = re.compile(r"^\[rank\d+\]: Traceback \(most recent call last\):", re.M)

# kind -> what must be seen. kernel: regex on the culprit node's kernel.log ("*": on every node);
# gpu: a field that must change on the culprit GPU; watchdog: fires on some ranks; stop: steps end early;
# slow: the culprit rank's fwd grows; stacks: dumped, with the culprit's stack differing from the majority.
FOOTPRINT = {
    "gpu_lost": dict(kernel=r"NVRM: Xid \(PCI:[0-9a-f:]+\): 79, .*fallen off the bus|NVRM: fallen off the bus and is not responding",
                     gpu="lost", watchdog=True, stop=True, nccl=r"CUDA error: unknown error"),
    "ecc_uncorrectable": dict(kernel=r"\): 48, .*double bit error", gpu="ecc_dbe", watchdog=True, stop=True,
                              nccl=r"uncorrectable ECC error encountered"),
    "row_remap_failure": dict(kernel=r"\): 64, .*Row Remapper Error", gpu="remap_failure", watchdog=True, stop=True),
    "nvlink_error": dict(kernel=r"\): 74, .*NVLink: fatal error detected on link \d+", gpu="nvlink_crc_errors",
                         watchdog=True, stop=True),
    "ib_link_persistent": dict(kernel=r"mlx5_\d+: Port: 1 Link DOWN", kernel_min=2, watchdog=True, stop=True,
                               nccl=r"NCCL WARN NET/IB : Got completion from peer .* status=12"),
    "ib_flap_transient": dict(kernel=r"mlx5_\d+: Port: 1 Link DOWN", kernel_max=1, watchdog=False, stop=False),
    "pcie_degradation": dict(kernel=r"AER: Corrected error received", gpu="pcie_replay", slow=True, stacks=True),
    "thermal_throttle": dict(gpu="throttle_reasons", slow=True, stacks=True),
    "host_oom": dict(kernel=r"Out of memory: Killed process \d+ \(python3\)", watchdog=True, stop=True,
                     launcher=r"exitcode: -9"),
    "hung_task": dict(kernel=r"INFO: task python3:\d+ blocked for more than 120 seconds", watchdog=True, stop=True,
                      stacks=True),
    "user_exception": dict(watchdog=False, stop=True, traceback_all=True),
    "nan_loss": dict(nan=True),
    "hang_stuck_rank": dict(watchdog=True, stop=True, stacks=True),
    "slow_storage": dict(kernel=r"nfs: server \S+ not responding", kernel_all=True, everyone_slower=True, stacks=True),
    "seq_surge": dict(surge=True),
    "driver_recovery": dict(kernel=r"\): 154, GPU recovery action changed from 0x0 \(None\) to 0x2 \(Node Reboot Required\)",
                            gpu="recovery_action", watchdog=True, stop=True),
    "app_xid": dict(kernel=r"\): 43, pid=\d+", kernel_all=True, watchdog=False, stop=True, traceback_all=True),
}


def _scenario(kind: str, seed: int = 11) -> Scenario:
    cluster = ClusterSpec(nodes=3, tp=4, pp=2, dp=3, microbatches=4, job="t")
    faults = () if kind == "healthy" else (FaultSpec(kind=kind, id="f1"),)
    return Scenario(ScenarioSpec(name=kind, seed=seed, cluster=cluster, duration_s=600, faults=faults))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scenario, Path]:
    sc = _scenario("healthy")
    return sc, write_batch_dir(sc, tmp_path_factory.mktemp("healthy"))


def _gpu_series(d: Path, node: str, gpu: int, field: str) -> list:
    return [orjson.loads(line)["gpus"][gpu][field] for line in (d / "nodes" / node / "gpu.jsonl").read_text().splitlines()]


def _steps(d: Path) -> list[dict]:
    return [orjson.loads(line) for f in sorted((d / "steps").glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_every_kind_has_a_footprint_entry() -> None:
    assert set(FOOTPRINT) == set(FAULTS)


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_fault_leaves_its_footprint(kind: str, tmp_path: Path, healthy: tuple[Scenario, Path]) -> None:
    sc = _scenario(kind)
    d = write_batch_dir(sc, tmp_path / kind)
    truth = orjson.loads((d / "truth.json").read_text())
    (f,) = truth["faults"]
    assert f["kind"] == kind and f["expected_action"] == FAULTS[kind].EXPECTED_ACTION
    fp = FOOTPRINT[kind]
    nodes = sc.cluster.node_names
    kernel = {n: (d / "nodes" / n / "kernel.log").read_text() for n in nodes}
    nccl = {n: "\n".join(p.read_text() for p in sorted((d / "nodes" / n / "nccl").glob("rank*.log"))) for n in nodes}
    launcher = "\n".join((d / "nodes" / n / "nccl" / "launcher.log").read_text() for n in nodes)

    if "kernel" in fp:
        where = nodes if fp.get("kernel_all") else f["nodes"]
        for n in where:
            hits = re.findall(fp["kernel"], kernel[n])
            assert len(hits) >= fp.get("kernel_min", 1), (n, kernel[n][:400])
            assert len(hits) <= fp.get("kernel_max", 10**6)
        for n in set(nodes) - set(where):
            assert not re.search(fp["kernel"], kernel[n])
    if "gpu" in fp:
        (g,) = f["gpus"]
        series = _gpu_series(d, g["node"], g["gpu"], fp["gpu"])
        assert series[0] != series[-1], f"{fp['gpu']} unchanged on the culprit GPU"
        other = (g["gpu"] + 1) % sc.cluster.gpus_per_node
        assert len(set(_gpu_series(d, g["node"], other, fp["gpu"])) - {0, 1}) == 0 or fp["gpu"] != "lost"
    all_nccl = "\n".join(nccl.values())
    if "watchdog" in fp:
        assert bool(WATCHDOG.search(all_nccl)) == fp["watchdog"]
        if fp["watchdog"] and f["ranks"] and kind != "ib_link_persistent":
            culprit = f["ranks"][0]
            log = (d / "nodes" / sc.topology.node_of(culprit) / "nccl" / f"rank{culprit}.log").read_text()
            assert not WATCHDOG.search(log), "the culprit rank must not be one of the waiters"
    if "nccl" in fp:
        assert re.search(fp["nccl"], nccl[f["nodes"][0]])
    if "launcher" in fp:
        assert re.search(fp["launcher"], launcher)
    steps = _steps(d)
    healthy_steps = _steps(healthy[1])
    last = max(s["step"] for s in steps)
    if fp.get("stop"):
        assert max(s["ts"] for s in steps) <= f["onset_ts"] + 1.0
        assert last < max(s["step"] for s in healthy_steps)
    if fp.get("stop") is False:
        assert last >= 0.9 * max(s["step"] for s in healthy_steps)
    if fp.get("slow"):
        culprit = f["ranks"][0]
        stage = sc.topology.coords(culprit)["pp"]
        after = [s for s in steps if s["ts"] > f["onset_ts"] + 5]

        def mean(key: str, mine: bool) -> float:
            xs = [s[key] / s["tokens"] for s in after if (s["rank"] == culprit) == mine and s["pp"] == stage]
            return sum(xs) / len(xs)

        assert mean("fwd_s", True) > 1.15 * mean("fwd_s", False)  # the slow rank computes longer
        assert mean("comm_s", True) < mean("comm_s", False)  # its peers wait for it
    if fp.get("stacks"):
        stacks = {int(p.stem): p.read_text() for p in (d / "stacks").glob("*.txt")}
        assert stacks and all(t.startswith("Process ") and '"MainThread"' in t for t in stacks.values())
        norm = {r: re.sub(r"\d{3,}", "N", t) for r, t in stacks.items()}
        counts: dict[str, int] = {}
        for t in norm.values():
            counts[t] = counts.get(t, 0) + 1
        majority = max(counts, key=counts.get)  # type: ignore[arg-type]
        if f["ranks"]:
            assert norm[f["ranks"][0]] != majority
    else:
        assert not (d / "stacks").exists()
    if fp.get("traceback_all"):
        for r in range(sc.topology.world_size):
            log = (d / "nodes" / sc.topology.node_of(r) / "nccl" / f"rank{r}.log").read_text()
            assert TRACEBACK.search(log)
        excs = {line.split("]: ", 1)[1] for line in all_nccl.splitlines() if re.match(r"\[rank\d+\]: \w+Error: ", line)}
        assert len(excs) == 1
    else:
        assert not TRACEBACK.search(all_nccl) or kind in ("ecc_uncorrectable", "row_remap_failure", "nvlink_error",
                                                           "ib_link_persistent")
    if fp.get("nan"):
        after = [s for s in steps if s["ts"] > f["onset_ts"]]
        assert after and all(s["loss"] is None for s in after)
        assert all(s["loss"] is not None for s in steps if s["ts"] < f["onset_ts"] - 60)
    if fp.get("everyone_slower") or fp.get("surge"):
        before = [s for s in steps if s["ts"] < f["onset_ts"] and s["rank"] == 0]
        during = [s for s in steps if f["onset_ts"] + 10 < s["ts"] < (f["end_ts"] or 1e12) and s["rank"] == 0]
        per_tok = lambda xs: sum(s["duration_s"] for s in xs) / len(xs)  # noqa: E731
        sq = lambda xs: sum(s["sum_len_sq"] for s in xs) / len(xs)  # noqa: E731
        assert per_tok(during) > 1.2 * per_tok(before)
        if fp.get("surge"):
            assert sq(during) > 1.4 * sq(before)  # the workload explains it
        else:
            assert sq(during) < 1.5 * sq(before)
            fwd = lambda xs: sum(s["fwd_s"] for s in xs) / len(xs)  # noqa: E731
            assert fwd(during) < 1.3 * fwd(before)
