"""Batch directories in other tools' shapes, written by hand, not by faultlens's simulator.

The simulator (datasets/) and faultlens's diagnosis were written by the same people, so
a scenario the simulator renders can share their blind spots. These directories follow
only the batch contract (DESIGN.md) and the shapes real producers print, chosen to
differ from the simulator's: syslog-prefixed kernel logs with boot-relative times beside
them, one steps file per host, GPU samples every 5 s with integers for flags and
``"N/A"`` where nvidia-smi prints it, NCCL logs with no time at all, tracebacks from one
rank per node (launchers kill the rest), ``"NaN"`` / ``"Infinity"`` as strings where a
JSON writer cannot emit them, py-spy dumps with idle threads. Used by
tests/test_diag_handwritten.py and benchmarks/handwritten.py.

Each scenario states what an operator would accept (``Expect``), never one exact output.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NODES = ("gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04")
JOB_ID = "llm-7b-run"
T0 = 1_764_000_000.0
STEP_S = 1.2  # nominal seconds per step, for placing events


def at(step: float) -> float:
    """The wall time of a step (nominal)."""
    return T0 + step * STEP_S


@dataclass
class Expect:
    """What an operator accepts: one of ``any_of`` (action type, nodes or None for any), none of ``forbid``."""

    any_of: tuple[tuple[str, tuple[str, ...] | None], ...] = ()
    forbid: tuple[str, ...] = ()
    nothing: bool = False  # no action at all but notify
    text: str = ""

    def judge(self, actions: list[dict[str, Any]]) -> tuple[bool, str]:
        acted = [(a["type"], tuple(sorted(a.get("nodes") or ()))) for a in actions]
        strong = [x for x in acted if x[0] != "notify"]
        if self.nothing:
            return (not strong, "no action" if not strong else f"unexpected {strong}")
        bad = [x for x in acted if x[0] in self.forbid]
        if bad:
            return False, f"forbidden {bad}"
        if not self.any_of:
            return True, f"{acted or 'no action'}"
        for kind, nodes in self.any_of:
            if any(k == kind and (nodes is None or n == tuple(sorted(nodes))) for k, n in acted):
                return True, f"{kind} {list(nodes) if nodes else ''}".strip()
        return False, f"got {acted or 'no action'}"


@dataclass
class Spec:
    name: str
    expect: Expect
    steps: int = 400
    stop_at: int | None = None  # no step record from this step on (a hang or a crash)
    slow: dict[int, float] = field(default_factory=dict)  # rank -> compute factor
    slow_from: int = 0
    slow_all: tuple[int, int, float] | None = None  # (from, to, factor) on every rank
    surge: tuple[int, int] | None = None  # long sequences over these steps
    nan_from: int | None = None
    grad_inf_first: dict[int, int] = field(default_factory=dict)  # rank -> step its grad norm overflows
    kernel: list[tuple[str, float, str]] = field(default_factory=list)  # (node or "*", ts, message)
    nccl: list[tuple[str, str]] = field(default_factory=list)  # (node, text), untimed
    gpu_hooks: list[Callable[[str, int, float, dict[str, Any]], None]] = field(default_factory=list)
    stacks: Callable[[int], str] | None = None
    seed: int = 7


def _job(d: Path) -> None:
    ranks = {str(n * 8 + g): {"node": node, "gpu": g} for n, node in enumerate(NODES) for g in range(8)}
    (d / "job.json").write_text(json.dumps({"job": JOB_ID, "tp": 8, "pp": 1, "dp": 4, "cp": 1,
                                            "order": "tp-cp-dp-pp", "ranks": ranks}))


def _syslog(ts: float, host: str, msg: str) -> str:
    t = time.gmtime(ts)
    day = time.strftime("%b %d", t).replace(" 0", "  ")
    return f"{day} {time.strftime('%H:%M:%S', t)} {host} kernel: [{ts - T0 + 35.0:12.6f}] {msg}"


def write(spec: Spec, d: Path) -> Path:
    """Write ``spec`` as a batch directory at ``d`` (created)."""
    rng = random.Random(spec.seed)
    d.mkdir(parents=True, exist_ok=True)
    _job(d)
    rows: dict[str, list[str]] = {n: [] for n in NODES}
    ts = last = T0
    for s in range(spec.steps):
        if spec.stop_at is not None and s >= spec.stop_at:
            break
        n_seqs = rng.randint(8, 32)
        lo, hi = (6000, 8192) if spec.surge and spec.surge[0] <= s < spec.surge[1] else (256, 4096)
        lens = [rng.randint(lo, hi) for _ in range(n_seqs)]
        sl, sq = sum(lens), sum(x * x for x in lens)
        base = 0.2 + sl * 2.5e-5 + sq * 1.5e-9
        comp = {}
        for r in range(32):
            f = spec.slow.get(r, 1.0) if s >= spec.slow_from else 1.0
            if spec.slow_all and spec.slow_all[0] <= s < spec.slow_all[1]:
                f *= spec.slow_all[2]
            comp[r] = base * f * rng.uniform(0.98, 1.02)
        dur = max(comp.values()) + 0.15
        for r in range(32):
            loss: float | str = round(2.5 * math.exp(-s / 800) + rng.uniform(-0.02, 0.02), 5)
            grad: float | str = round(1.0 + rng.uniform(-0.1, 0.1), 4)
            if s >= spec.grad_inf_first.get(r, 1 << 30):
                grad = "Infinity"
            if spec.nan_from is not None and s >= spec.nan_from:
                loss, grad = "NaN", "NaN"  # as a JSON writer that cannot emit NaN prints them
            rows[NODES[r // 8]].append(json.dumps({
                "v": 1, "ts": round(ts + dur, 3), "job": JOB_ID, "rank": r, "node": NODES[r // 8], "step": s,
                "duration_s": round(dur, 4), "n_seqs": n_seqs, "sum_len": sl, "sum_len_sq": sq, "tokens": sl,
                "loss": loss, "grad_norm": grad, "fwd_s": round(comp[r] / 3, 4), "bwd_s": round(2 * comp[r] / 3, 4),
                "comm_s": round(dur - comp[r], 4)}))
        ts += dur
        last = ts
    end = T0 + spec.steps * STEP_S
    (d / "steps").mkdir(exist_ok=True)
    for n in NODES:  # one file per host, as a launcher that logs per host writes them
        (d / "steps" / f"{n}.jsonl").write_text("\n".join(rows[n]) + ("\n" if rows[n] else ""))
    for ni, n in enumerate(NODES):
        nd = d / "nodes" / n
        (nd / "nccl").mkdir(parents=True, exist_ok=True)
        lines = []
        t = T0
        while t < end:
            gpus = []
            for g in range(8):
                st: dict[str, Any] = {
                    "index": g, "uuid": f"GPU-{ni:02d}{g:02d}aaaa-0000-0000-0000-000000000000",
                    "pci_bus": f"00000000:{0x18 + g * 0x10:02X}:00.0", "util": 97 if t < last else 100,
                    "mem_used_mb": 71234, "temp_c": 61 + rng.randint(0, 4), "power_w": round(640.5 + rng.uniform(-20, 20), 2),
                    "sm_clock_mhz": 1980, "throttle_reasons": 0, "ecc_sbe": 0, "ecc_dbe": 0,
                    "retired_pages": "N/A", "remap_pending": 0, "pcie_replay": 0, "nvlink_errors": 0}
                for hook in spec.gpu_hooks:
                    hook(n, g, t, st)
                if not st.pop("gone", False):  # a GPU NVML no longer lists is left out of the sample
                    gpus.append(st)
            lines.append(json.dumps({"v": 1, "ts": round(t, 3), "node": n, "gpus": gpus}))
            t += 5.0
        (nd / "gpu.jsonl").write_text("\n".join(lines) + "\n")
        kernel = [_syslog(T0 - 30, n, "EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode. Quota mode: none."),
                  _syslog(T0 - 29, n, f"mlx5_core 0000:{0x0c + ni:02x}:00.0: Port module event: module 0, Cable plugged"),
                  _syslog(T0 - 28, n, "IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready")]
        kernel += [_syslog(t, n, m) for host, t, m in sorted(spec.kernel, key=lambda x: x[1]) if host in (n, "*")]
        (nd / "kernel.log").write_text("\n".join(kernel) + "\n")
        nccl = [f"{n}:{4000 + r}:{4100 + r} [{r % 8}] NCCL INFO Bootstrap : Using ib0:10.0.0.{ni + 1}<0>"
                for r in range(ni * 8, ni * 8 + 8)]
        nccl += [text for host, text in spec.nccl if host == n]
        (nd / "nccl" / "ranks.log").write_text("\n".join(nccl) + "\n")
    if spec.stacks is not None:
        (d / "stacks").mkdir(exist_ok=True)
        for r in range(32):
            (d / "stacks" / f"{r}.txt").write_text(spec.stacks(r))
    return d


def pyspy(rank: int, *, odd: bool) -> str:
    """A py-spy dump of one rank: in all_reduce, or (``odd``) stuck in the data loader."""
    head = f"Process {20000 + rank}: /usr/bin/python3 -u train.py --config cfg.yaml\nPython v3.10.12 (/usr/bin/python3.10)\n\n"
    frames = (["__getitem__ (dataset.py:212)", "fetch (torch/utils/data/_utils/fetch.py:51)",
               "_next_data (torch/utils/data/dataloader.py:677)", "__next__ (torch/utils/data/dataloader.py:633)",
               "train_step (train.py:145)", "main (train.py:301)", "<module> (train.py:320)"] if odd else
              ["all_reduce (torch/distributed/distributed_c10d.py:2050)", "wrapper (torch/distributed/c10d_logger.py:75)",
               "reduce_gradients (engine.py:88)", "train_step (train.py:160)", "main (train.py:301)", "<module> (train.py:320)"])
    main = 'Thread 0x7F5E2A1B4740 (active): "MainThread"\n' + "".join(f"    {f}\n" for f in frames)
    idle = 'Thread 0x7F5D11FFF640 (idle): "Thread-2 (_pin_memory_loop)"\n    select (selectors.py:416)\n    wait (multiprocessing/connection.py:931)\n'
    return head + main + idle


def _traceback(rank: int) -> str:
    return "\n".join(f"[rank{rank}]: {x}" for x in (
        "Traceback (most recent call last):", '  File "/workspace/train.py", line 160, in train_step',
        "    out = model(batch)", "KeyError: 'attention_mask'"))


def _hook_pcie(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a03" and g == 5 and t > at(120):
        st["pcie_replay"] = int((t - at(120)) / 5.0) * 400


def _hook_thermal(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a01" and g == 2 and t > at(100):
        st.update(temp_c=93, sm_clock_mhz=1350, throttle_reasons=0x48)


def _hook_dbe(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a04" and g == 3 and t > at(250):
        st["ecc_dbe"] = 1


def _hook_vanish(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a02" and g == 6 and t > at(180):
        st["gone"] = True


def _hook_nvlink(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a03" and g == 1 and t > at(150):
        st["nvlink_errors"] = int((t - at(150)) / 5.0) * 250


def _hook_remap_failure(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a04" and g == 7 and t > at(200):
        st.update(remap_failure=1, remap_pending=1)


def _hook_remap_pending(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a01" and g == 4 and t > at(200):
        st["remap_pending"] = "Yes"


def _hook_sbe(n: str, g: int, t: float, st: dict[str, Any]) -> None:
    if n == "gpu-a02" and g == 3 and t > at(100):
        st["ecc_sbe"] = int((t - at(100)) / 5.0) * 40


def scenarios() -> list[Spec]:
    """Every hand-written scenario, with what an operator would accept."""
    ib_errors = [(NODES[2], f"{NODES[2]}:{5000 + r}:{5100 + r} [{r % 8}] transport/net_ib.cc:1696 NCCL WARN NET/IB : "
                  f"Got completion from peer 10.0.0.4<{40000 + r}> with status=12 opcode=0 len=0 vendor err 129 (Recv) "
                  "localGid ::ffff:10.0.0.3 remoteGids::ffff:10.0.0.4 hca mlx5_2") for r in range(16, 24)]
    watchdogs = [(NODES[r // 8], f"[rank{r}]:[E1124 16:01:{10 + r:02d}.123456789 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog "
                  "caught collective operation timeout: WorkNCCL(SeqNum=48211, OpType=ALLREDUCE, NumelIn=262144, "
                  "NumelOut=262144, Timeout(ms)=600000) ran for 600087 milliseconds before timing out.") for r in range(32)]
    return [
        Spec("healthy", Expect(nothing=True, text="nothing")),
        Spec("xid79", Expect(any_of=(("evict_nodes", ("gpu-a02",)),), text="evict gpu-a02"), stop_at=200,
             kernel=[("gpu-a02", at(199), "NVRM: Xid (PCI:0000:38:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
                     ("gpu-a02", at(199) + 0.01, "NVRM: GPU 0000:38:00.0: GPU has fallen off the bus.")]),
        Spec("ecc_dbe", Expect(any_of=(("evict_nodes", ("gpu-a04",)), ("run_diagnostics", ("gpu-a04",))), text="evict gpu-a04"),
             stop_at=252, gpu_hooks=[_hook_dbe],
             kernel=[("gpu-a04", at(250) + 1, "NVRM: Xid (PCI:0000:48:00): 48, pid=30211, name=python3, An uncorrectable "
                      "double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0."),
                     ("gpu-a04", at(250) + 1.5, "NVRM: Xid (PCI:0000:48:00): 94, pid=30211, name=python3, Contained: SM (0x1). RST: No, D-RST: No")]),
        Spec("ib_persistent", Expect(any_of=(("evict_nodes", ("gpu-a03",)),), text="evict gpu-a03"), stop_at=220,
             nccl=ib_errors + watchdogs,
             kernel=[("gpu-a03", at(210), "mlx5_core 0000:0e:00.0 ib0: Link down"), ("gpu-a03", at(212), "mlx5_core 0000:0e:00.0 ib0: Link up"),
                     ("gpu-a03", at(216), "mlx5_core 0000:0e:00.0 ib0: Link down"), ("gpu-a03", at(219), "mlx5_core 0000:0e:00.0 ib0: Link up")]),
        Spec("ib_flap_once", Expect(forbid=("evict_nodes",), text="no eviction"),
             kernel=[("gpu-a04", at(200), "mlx5_core 0000:0f:00.0 ib0: Link down"), ("gpu-a04", at(203), "mlx5_core 0000:0f:00.0 ib0: Link up")]),
        Spec("host_oom", Expect(any_of=(("restart_job", None),), forbid=("evict_nodes",), text="restart"), stop_at=150,
             kernel=[("gpu-a02", at(150), "python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0"),
                     ("gpu-a02", at(150) + 0.2, "Out of memory: Killed process 30211 (python3) total-vm:912345672kB, anon-rss:523456780kB, "
                      "file-rss:123456kB, shmem-rss:0kB, UID:1000 pgtables:1234567kB oom_score_adj:0")]),
        Spec("user_exception", Expect(any_of=(("rollback_code", None),), forbid=("evict_nodes",), text="rollback"), stop_at=180,
             nccl=[(NODES[i], _traceback(i * 8)) for i in range(4)]),
        Spec("hang_silent", Expect(any_of=(("evict_nodes", ("gpu-a02",)), ("restart_job", None)), text="evict gpu-a02 (rank 13)"),
             stop_at=250, stacks=lambda r: pyspy(r, odd=(r == 13))),
        Spec("storage_stall", Expect(any_of=(("notify", None),), forbid=("evict_nodes", "run_diagnostics"), text="job-wide notify"),
             slow_all=(150, 260, 4.0),
             kernel=[("*", at(160) + i * 7, m) for i, m in enumerate([
                 "nfs: server 10.1.0.5 not responding, still trying", "INFO: task python3:23101 blocked for more than 120 seconds.",
                 "      Tainted: P           OE     5.15.0-91-generic #101-Ubuntu",
                 "\"echo 0 > /proc/sys/kernel/hung_task_timeout_secs\" disables this message.", "nfs: server 10.1.0.5 OK"])]),
        Spec("nan_no_culprit", Expect(any_of=(("run_diagnostics", NODES),), forbid=("evict_nodes",), text="diagnostics on the job"),
             nan_from=300),
        Spec("nan_culprit", Expect(any_of=(("run_diagnostics", ("gpu-a02",)),), forbid=("evict_nodes",), text="diagnostics on gpu-a02"),
             nan_from=300, grad_inf_first={13: 298}),
        Spec("pcie_slow", Expect(any_of=(("evict_nodes", ("gpu-a03",)), ("adapt_parallelism", ("gpu-a03",))), text="gpu-a03"),
             slow={21: 1.18}, slow_from=120, gpu_hooks=[_hook_pcie]),
        Spec("thermal", Expect(any_of=(("evict_nodes", ("gpu-a01",)), ("adapt_parallelism", ("gpu-a01",))), text="gpu-a01"),
             slow={2: 1.35}, slow_from=100, gpu_hooks=[_hook_thermal]),
        Spec("failslow_only", Expect(any_of=(("evict_nodes", ("gpu-a03",)), ("adapt_parallelism", ("gpu-a03",))), text="gpu-a03"),
             slow={21: 1.3}, slow_from=150),
        Spec("failslow_small", Expect(forbid=("evict_nodes", "adapt_parallelism"), text="8% on one rank: no eviction"),
             slow={5: 1.08}, slow_from=150),
        Spec("seq_surge", Expect(nothing=True, text="nothing (long sequences)"), surge=(150, 200)),
        Spec("gpu_vanished", Expect(any_of=(("evict_nodes", ("gpu-a02",)),), text="evict gpu-a02 (a GPU left the samples)"),
             stop_at=182, gpu_hooks=[_hook_vanish]),
        Spec("nvlink_counters", Expect(any_of=(("evict_nodes", ("gpu-a03",)), ("run_diagnostics", ("gpu-a03",))),
                                       text="gpu-a03 (NVLink errors climbing)"), slow={9: 1.1}, slow_from=150,
             gpu_hooks=[_hook_nvlink]),
        Spec("remap_failure_flag", Expect(any_of=(("evict_nodes", ("gpu-a04",)),), text="evict gpu-a04 (remap failure)"),
             gpu_hooks=[_hook_remap_failure]),
        Spec("remap_pending_flag", Expect(forbid=("evict_nodes",), text="no eviction (a pending remap wants a reset)"),
             gpu_hooks=[_hook_remap_pending]),
        Spec("sbe_storm", Expect(forbid=("evict_nodes",), text="no eviction (correctable errors)"), gpu_hooks=[_hook_sbe]),
        # issue 23: a fault explains its symptoms; one verdict per fault
        Spec("xid48_then_watchdogs", Expect(any_of=(("evict_nodes", ("gpu-a04",)), ("run_diagnostics", ("gpu-a04",))),
                                            forbid=("restart_job",), text="gpu-a04 only (the watchdogs are its symptoms)"),
             stop_at=252, kernel=[("gpu-a04", at(250) + 1, "NVRM: Xid (PCI:0000:48:00): 48, pid=30211, name=python3, An "
                                   "uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at "
                                   "partition 6, subpartition 0.")],
             nccl=[(NODES[r // 8], w.replace("16:01:", "16:15:")) for r, (_, w) in enumerate(watchdogs)]),
        Spec("storage_silence", Expect(any_of=(("notify", None),), forbid=("evict_nodes", "run_diagnostics"),
                                       text="job-wide notify (the silence is the stall's)"), stop_at=160,
             kernel=[("*", at(158) + i * 7, m) for i, m in enumerate([
                 "nfs: server 10.1.0.5 not responding, still trying", "INFO: task python3:23101 blocked for more than 120 seconds.",
                 "      Tainted: P           OE     5.15.0-91-generic #101-Ubuntu",
                 "\"echo 0 > /proc/sys/kernel/hung_task_timeout_secs\" disables this message."])]),
        Spec("segfault_in_libc", Expect(any_of=(("restart_job", None),), forbid=("evict_nodes", "run_diagnostics"),
                                        text="restart (the silence is the crash's)"), stop_at=200,
             kernel=[("gpu-a02", at(200), "python3[30211]: segfault at 0 ip 00007f3a2c8e1a40 sp 00007ffd5b2c1e28 error 4 in "
                      "libc.so.6[7f3a2c800000+195000]")]),
        Spec("exception_every_rank", Expect(any_of=(("rollback_code", None),), forbid=("evict_nodes",), text="rollback"),
             stop_at=180, nccl=[(NODES[r // 8], _traceback(r)) for r in range(32)]),
        Spec("xid63_informational", Expect(nothing=True, text="nothing (a row marked for remapping)"),
             kernel=[("gpu-a02", at(100), "NVRM: Xid (PCI:0000:38:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: "
                      "New row (0x00000012bac1c3e0) marked for remapping, reset gpu to activate.")]),
        Spec("fabric_storm", Expect(forbid=("evict_nodes",), text="no eviction (every node's IB link at once)"),
             stop_at=260, kernel=[(n, at(250) + i * 0.3 + k * 20, f"mlx5_core 0000:0{c}:00.0 ib{c}: Link {'down' if k % 2 == 0 else 'up'}")
                                  for i, n in enumerate(NODES) for c in range(2) for k in range(4)]),
    ]
