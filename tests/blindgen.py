"""Fault scenarios written the way another tool would write them, blind to faultlens's code.

Nothing here imports datasets/ (the simulator) or tests/handwritten.py: the directories
follow only the batch contract in DESIGN.md ("Batch path") and the shapes real producers
print. They differ from the simulator on purpose: node names like ``gpu-a100-017`` or
``10-0-3-7``, 4 or 8 GPUs per node, 2-16 nodes, kernel logs as syslog, journald
short-iso, ``dmesg -T`` or raw ``dmesg`` with uptime stamps only, mixed with real noise
(boot, ACPI, systemd, audit, benign NVRM lines), NCCL INFO chatter behind torchrun
prefixes (``[default3]:``, ``[rank5]:``), GPU samples in nvidia-smi strings (``"72 C"``,
``"N/A"``, missing fields) every 5 s or 10 s, step times driven by variable sequence
lengths. Fault and noise lines are real ones (datasets/conformance and
/work/shared/reference/real-logs, copied verbatim as text, PCI ids substituted).

Each scenario carries its ground truth: the culprit nodes and what an outside operator
accepts (``Truth``), never one exact output. Used by benchmarks/blind.py and
tests/test_diag_blind.py.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = (
    "healthy", "xid79", "xid48_watchdog", "xid94", "xid95", "xid64_remap", "xid_user", "xid74_nvlink",
    "ib_flap", "ib_down", "thermal", "slow_gpu", "hang", "user_exception", "nan_loss", "oom_killer",
    "storage_stall", "pcie_aer_fatal", "sxid_fatal", "ckpt_pause",
    # issue 36: the driver's stated recovery (Xid 154 after 109/119/120/79), application Xids with
    # their tracebacks (Xid 43 alone too), one rank's "CUDA error: unknown error" on a failing GPU
    "xid154_recovery", "xid_app_traceback", "cuda_unknown_failing_gpu",
    # the collective's watchdog a whole timeout later (PyTorch's default 30 min) after an Xid 48/79/94
    "late_watchdog",
)

# PCI buses as nvidia-smi prints them on real boards (DGX A100, HGX H100, 4-GPU servers).
BUSES = {
    8: (("07", "0f", "47", "4e", "87", "90", "b7", "bd"), ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")),
    4: (("01", "41", "81", "c1"), ("17", "65", "ca", "e3")),
}

# Benign lines, verbatim from datasets/conformance/negative.jsonl and real-logs (their
# own stamps removed: the writer adds this node's stamp).
NOISE_BOOT = (
    "Linux version 6.2.0-37-generic (buildd@bos03-amd64-055) (x86_64-linux-gnu-gcc-11 (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0, GNU ld (GNU Binutils for Ubuntu) 2.38) #38~22.04.1-Ubuntu SMP PREEMPT_DYNAMIC Thu Nov  2 18:01:13 UTC 2",
    "BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable",
    "Spectre V2 : Mitigation: Enhanced IBRS",
    "MMIO Stale Data: Vulnerable: Clear CPU buffers attempted, no microcode",
    "NMI watchdog: Perf NMI watchdog permanently disabled",
    "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build  (dvs-builder@U22-I3-B10-02-5)  Mon Jun  2 13:13:04 UTC 2025",
    "NVRM: gpuClearFbhubPoisonIntrForBug2924523_GA100: FBHUB Interrupt detected. Clearing it.",
    "NVRM: Persistence mode is deprecated and will be removed in a future release. Please use nvidia-persistenced instead.",
    "mlx5_core 0000:{nic}:00.0: firmware version: 28.39.1002",
    "mlx5_core 0000:{nic}:00.0: Port module event: module 0, Cable plugged",
    "mlx5_core 0000:{nic}:00.0: Rate limit: 127 rates are supported, range: 0Mbps to 24414Mbps",
    "[drm] [nvidia-drm] [GPU ID 0x00001800] Loading driver",
    "SGI XFS with ACLs, security attributes, no debug enabled",
    "XFS (md127): Mounting V5 Filesystem",
    "ACPI BIOS Error (bug): Could not resolve symbol [\\_SB.PCI0.SAT0.SPT4._GTF.DSSP], AE_NOT_FOUND (20210331/psargs-330)",
    "ACPI Error: Aborting method \\_SB.PCI0.SAT0.SPT1._GTF due toprevious error (AE_NOT_FOUND) (20210730/psparse-529)",
    "nvidia-nvswitch0: open (major=510)",
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    "wireguard: WireGuard 1.0.0 loaded. See www.wireguard.com for information.",
    "Initializing XFRM netlink socket",
    "NVRM: GPU at PCI:0000:{bus}:00: GPU-509665ad-b600-ac93-3616-d754b23d636d",
    "NVRM: GPU Board Serial Number: 1650124014249",
)
NOISE_RUN = (
    "perf: interrupt took too long (2509 > 2500), lowering kernel.perf_event_max_sample_rate to 79500",
    "clocksource: Long readout interval, skipping watchdog check: cs_nsec: 1584036171 wd_nsec: 1584036160",
    "IPv6: ADDRCONF(NETDEV_CHANGE): calib317e2eeb40: link becomes ready",
    "docker0: port 1(vetha17b2cc) entered disabled state",
    "device veth9d4400a entered promiscuous mode",
    "IPv6: ADDRCONF(NETDEV_UP): veth9d4400a: link is not ready",
    "workqueue: ib_cache_event_task [ib_core] hogged CPU for >10000us 4 times, consider switching to WQ_UNBOUND",
    "bond0: (slave enp83s0f0np0): link status definitely up, 100000 Mbps full duplex",
    "mce: CPU6: Core temperature/speed normal",
    "pcieport 0000:00:03.0: AER: Corrected error received: 0000:00:03.0",
    "EXT4-fs (md127p3): re-mounted 0f3cd65a-338b-4574-bba3-ecef214e1917 r/w. Quota mode: none.",
)
# Not from the kernel: other programs in the same syslog/journal (only where the format has a program field).
NOISE_PROGRAMS = (
    ("systemd[1]", "Started systemd-journald.service - Journal Service."),
    ("systemd[1]", "Starting systemd-udev-trigger.service - Coldplug All udev Devices..."),
    ("systemd[1]", "Started Session 4211 of User slurm."),
    ("audit[2231]", "AVC apparmor=\"STATUS\" operation=\"profile_replace\" profile=\"unconfined\" name=\"nvidia_modprobe\" pid=2231 comm=\"apparmor_parser\""),
    ("ntpd[1403]", "0.0.0.0 c618 08 no_sys_peer"),
    ("nvidia-persistenced[1822]", "Started (1822)"),
    ("sshd[40121]", "Accepted publickey for slurm from 10.0.0.2 port 51234 ssh2: ED25519 SHA256:Qm3dXc"),
    # verbatim from LogHub's Linux sample (logpai/loghub Linux/Linux_2k.log): other daemons' failures
    ("sshd(pam_unix)[20882]", "authentication failure; logname= uid=0 euid=0 tty=NODEVssh ruser= rhost=220-135-151-1.hinet-ip.hinet.net  user=root"),
    ("klogind[19272]", "Authentication failed from 163.27.187.39 (163.27.187.39): Permission denied in replay cache code "),
    ("klogind[19274]", "Kerberos authentication failed "),
    ("logrotate", "ALERT exited abnormally with [1]"),
)
NCCL_CHATTER = (
    "NCCL INFO Bootstrap : Using eth0:10.10.6.118<0>",
    "NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation",
    "NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB ; OOB eth0:10.10.6.118<0>",
    "NCCL INFO Using network IB",
    "NCCL INFO Setting affinity for GPU {g} to 0fffff00,000fffff",
    "NCCL INFO Channel 00/0 : {r}[{g}] -> {p}[{pg}] via P2P/CUMEM",
    "NCCL INFO Channel 03/0 : {r}[{g}] -> {p}[{pg}] [send] via NET/IB/3/GDRDMA",
    "NCCL INFO Connected all rings",
    "NCCL INFO Connected all trees",
    "NCCL INFO threadThresholds 8/8/64 | 128/8/64 | 8/8/64",
    "NCCL INFO 24 coll channels, 32 p2p channels, 32 p2p channels per peer",
    "NCCL INFO comm 0x55cd1a0bf930 rank {r} nranks {n} cudaDev {g} busId {bus}000 - Init COMPLETE",
)


@dataclass
class Truth:
    """What an outside operator accepts: one of ``any_of`` ((action, nodes or None)), none of ``forbid``."""

    culprits: tuple[str, ...] = ()
    job_level: bool = False  # the fault is the job's, not a machine's (user code, storage)
    any_of: tuple[tuple[str, tuple[str, ...] | None], ...] = ()
    forbid: tuple[str, ...] = ()
    nothing: bool = False  # nothing beyond notify
    text: str = ""

    def judge(self, actions: list[dict[str, Any]]) -> tuple[bool, str]:
        acted = [(a.get("type", ""), tuple(sorted(a.get("nodes") or ()))) for a in actions]
        strong = [x for x in acted if x[0] != "notify"]
        wrong_evict = [x for x in acted if x[0] == "evict_nodes" and set(x[1]) - set(self.culprits)]
        if wrong_evict:
            return False, f"evicted healthy {wrong_evict}"
        if self.nothing:
            return (not strong, "nothing" if not strong else f"unexpected {strong}")
        bad = [x for x in acted if x[0] in self.forbid]
        if bad:
            return False, f"forbidden {bad}"
        for kind, nodes in self.any_of:
            for k, n in acted:
                if k == kind and (nodes is None or n == tuple(sorted(nodes))):
                    return True, f"{k} {','.join(n)}".strip()
        return False, f"got {acted or 'no action'}"


@dataclass
class Scenario:
    name: str
    kind: str
    seed: int
    nodes: list[str]
    gpn: int
    truth: Truth = field(default_factory=Truth)
    # pin a random choice: hard, kfmt, distract, distract_at ("fault"), n_steps, pp, hang_variant, drop (ranks)
    force: dict[str, Any] = field(default_factory=dict)


class _Writer:
    """Renders one scenario into a batch directory."""

    def __init__(self, sc: Scenario, root: Path) -> None:
        self.sc, self.root = sc, root
        self.rng = random.Random(sc.seed * 7919 + 13)
        rng = self.rng
        self.t0 = 1_795_000_000.0 + sc.seed * 3600.0 + rng.uniform(0, 600)
        self.kfmt = rng.choice(("syslog", "syslog_uptime", "journal_iso", "journal_iso_tz", "rfc3339", "dmesg_T", "dmesg_raw",
                                "dmesg_iso_x", "short_precise"))
        self.hard = rng.random() < 0.6  # distractors on healthy nodes, harder fault variants
        self.kfmt, self.hard = sc.force.get("kfmt", self.kfmt), sc.force.get("hard", self.hard)
        self.buses = rng.choice(BUSES[sc.gpn])
        self.nic = rng.choice(("5c", "d2", "41", "53"))
        self.sample_s = rng.choice((5.0, 10.0))
        self.n_ranks = len(sc.nodes) * sc.gpn
        self.kernel: dict[str, list[tuple[float, str]]] = {n: [] for n in sc.nodes}
        self.nccl: dict[str, list[tuple[int, str]]] = {n: [] for n in sc.nodes}  # (rank, line)
        self.uptime0 = {n: rng.uniform(2_000, 900_000) for n in sc.nodes}
        self.pid = {r: 40_000 + rng.randint(0, 9_000) + r for r in range(self.n_ranks)}
        # the run: steps, a stop step (crash / hang), slow ranks, NaN
        self.n_steps = int(sc.force.get("n_steps", rng.randint(320, 420)))
        nn = len(sc.nodes)
        self.pp = 2 if nn >= 4 and nn % 2 == 0 and rng.random() < 0.3 else 1
        self.pp = int(sc.force.get("pp", self.pp))
        fmts = ("syslog", "journal_iso", "rfc3339", "dmesg_T", "short_precise")
        self.node_fmt = {n: rng.choice(fmts) for n in sc.nodes} if self.hard and "kfmt" not in sc.force and rng.random() < 0.3 else {}
        self.skew = {rng.choice(sc.nodes): rng.choice((-1, 1)) * rng.uniform(20, 90)} if self.hard and rng.random() < 0.3 else {}
        self.stop_step: int | None = None
        self.pause_step: int | None = None  # every rank pauses after this step for pause_s (a checkpoint save)
        self.pause_s = 0.0
        self.slow: dict[int, float] = {}
        self.slow_from = 0
        self.nan_from: int | None = None
        self.nan_text = rng.choice(("NaN", "nan", None, None))  # some writers quote it
        self.gpu_mods: list[Any] = []
        self.stacks: dict[int, str] | None = None
        self.splits = rng.random() < 0.7
        self.busy_after_stop = False  # a hang keeps the GPUs spinning in NCCL kernels

    # ---------------- helpers
    def node_of(self, rank: int) -> str:
        return self.sc.nodes[rank // self.sc.gpn]

    def bus(self, gpu: int) -> str:
        return self.buses[gpu]

    def kline(self, node: str, ts: float, msg: str, prog: str = "kernel") -> str:
        up = ts - self.t0 + self.uptime0[node]
        ts += self.skew.get(node, 0.0)
        kfmt = self.node_fmt.get(node, self.kfmt)
        t = time.gmtime(ts)
        host = node
        if kfmt == "syslog":
            return f"{time.strftime('%b', t)} {t.tm_mday:2d} {time.strftime('%H:%M:%S', t)} {host} {prog}: {msg}"
        if kfmt == "syslog_uptime":
            stamp = f"[{up:12.6f}] " if prog == "kernel" else ""
            return f"{time.strftime('%b', t)} {t.tm_mday:2d} {time.strftime('%H:%M:%S', t)} {host} {prog}: {stamp}{msg}"
        if kfmt == "journal_iso":
            return f"{time.strftime('%Y-%m-%dT%H:%M:%S', t)}+0000 {host} {prog}: {msg}"
        if kfmt == "syslog_local":  # rsyslog's traditional format on a host whose clock is UTC+8: local time, no zone
            lt = time.gmtime(ts + 8 * 3600)
            return f"{time.strftime('%b', lt)} {lt.tm_mday:2d} {time.strftime('%H:%M:%S', lt)} {host} {prog}: {msg}"
        if kfmt == "journal_iso_tz":  # a cluster in UTC+8: the wall clock in local time with its offset
            lt = time.gmtime(ts + 8 * 3600)
            return f"{time.strftime('%Y-%m-%dT%H:%M:%S', lt)}+0800 {host} {prog}: {msg}"
        if kfmt == "rfc3339":  # rsyslog's high-precision default
            frac = f"{ts % 1:.6f}"[1:]
            return f"{time.strftime('%Y-%m-%dT%H:%M:%S', t)}{frac}+00:00 {host} {prog}: {msg}"
        if kfmt == "dmesg_iso_x":  # dmesg -x --time-format iso: facility and level decoded
            return f"kern  :warn  : {time.strftime('%Y-%m-%dT%H:%M:%S', t)},{int(ts % 1 * 1e6):06d}+00:00 {msg}"
        if kfmt == "short_precise":  # journalctl -o short-precise
            return f"{time.strftime('%b', t)} {t.tm_mday:02d} {time.strftime('%H:%M:%S', t)}.{int(ts % 1 * 1e6):06d} {host} {prog}: {msg}"
        if kfmt == "dmesg_T":
            return f"[{time.strftime('%a %b', t)} {t.tm_mday:2d} {time.strftime('%H:%M:%S %Y', t)}] {msg}"
        return f"[{up:12.6f}] {msg}"

    def at(self, step: int) -> float:
        """Wall time at which ``step`` ends on a healthy run."""
        return self.cum[min(step, len(self.cum) - 1)]

    def xid(self, gpu: int, code: int, text: str, pid: int | None = None, name: str = "python3") -> str:
        who = f"pid={pid}, name={name}" if pid else "pid='<unknown>', name=<unknown>"
        return f"NVRM: Xid (PCI:0000:{self.bus(gpu)}:00): {code}, {who}, {text}"

    def watchdogs(self, ts: float, ranks: list[int], seq: int, timeout_s: int = 600) -> None:
        """ProcessGroupNCCL watchdog timeouts on ``ranks`` at ``ts`` (glog prefix, torchrun rank prefix)."""
        for r in ranks:
            t = time.gmtime(ts + r * 0.003)
            glog = f"E{t.tm_mon:02d}{t.tm_mday:02d} {time.strftime('%H:%M:%S', t)}.{self.rng.randint(0, 999999):06d} {self.pid[r]}"
            self.nccl[self.node_of(r)].append((r, f"[rank{r}]:[{glog} ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=262144000, NumelOut=262144000, Timeout(ms)={timeout_s * 1000}) ran for {timeout_s}{self.rng.randint(10, 99):03d} milliseconds before timing out."))
            self.nccl[self.node_of(r)].append((r, f"[rank{r}]:[{glog} ProcessGroupNCCL.cpp:1664] [PG ID 0 PG GUID 0(default_pg) Rank {r}] Exception (either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: {seq}, last completed NCCL work: {seq - 1}."))

    def traceback(self, ranks: list[int], exc: list[str], prefix: str = "rank") -> None:
        for r in ranks:
            tag = f"[{prefix}{r if prefix == 'rank' else r % self.sc.gpn}]:"
            lines = ["Traceback (most recent call last):",
                     '  File "/workspace/train.py", line 412, in <module>',
                     "    main(cfg)",
                     '  File "/workspace/train.py", line 377, in main',
                     "    loss = train_step(model, batch, optimizer)",
                     '  File "/workspace/train.py", line 215, in train_step',
                     "    logits = model(batch[\"input_ids\"], attention_mask=batch[\"attention_mask\"])",
                     '  File "/usr/local/lib/python3.10/dist-packages/torch/nn/modules/module.py", line 1553, in _wrapped_call_impl',
                     "    return self._call_impl(*args, **kwargs)", *exc]
            for ln in lines:
                self.nccl[self.node_of(r)].append((r, tag + ln))

    def gpu_mod(self, fn: Any) -> None:
        self.gpu_mods.append(fn)

    # ---------------- writing
    def write(self) -> Path:
        sc, rng = self.sc, self.rng
        d = self.root
        d.mkdir(parents=True, exist_ok=True)
        scale = rng.uniform(1.4, 3.2)  # model size: seconds per unit of workload
        self.work = []
        for _ in range(self.n_steps):
            n = rng.randint(6, 48)
            lens = [min(8192, int(rng.lognormvariate(6.6, 0.9))) for _ in range(n)]
            if rng.random() < 0.05:
                lens += [8192] * rng.randint(1, 4)
            sl, sq = sum(lens), sum(x * x for x in lens)
            self.work.append((len(lens), sl, sq, scale * (0.15 + sl * 9e-6 + sq * 2.0e-9)))
        self.cum = [self.t0]
        for *_, base in self.work:
            self.cum.append(self.cum[-1] + base + 0.09)
        _inject(self)
        ranks = {str(r): {"node": self.node_of(r), "gpu": r % sc.gpn} for r in range(self.n_ranks)}
        nn, pp = len(sc.nodes), self.pp
        (d / "job.json").write_text(json.dumps({"job": f"pretrain-{sc.seed:04d}", "tp": sc.gpn, "pp": pp,
                                                "dp": nn // pp, "cp": 1, "order": "tp-cp-dp-pp", "ranks": ranks},
                                               indent=rng.choice((None, 2))))
        last_ts = self._steps(d)
        self._gpu(d, last_ts)
        self._kernel(d, last_ts)
        self._nccl(d)
        if self.stacks:
            (d / "stacks").mkdir(exist_ok=True)
            for r, text in self.stacks.items():
                (d / "stacks" / f"{r}.txt").write_text(text)
        return d

    def _steps(self, d: Path) -> float:
        sc, rng = self.sc, self.rng
        (d / "steps").mkdir(exist_ok=True)
        layout = rng.choice(("node", "rank", "one"))
        files: dict[str, list[str]] = {}
        job = f"pretrain-{sc.seed:04d}"
        ts = self.t0
        end = self.stop_step if self.stop_step is not None else self.n_steps
        for s in range(end):
            if self.pause_step is not None and s == self.pause_step + 1:
                self._pause_lines(ts)
                ts += self.pause_s
            n_seqs, sl, sq, base = self.work[s]
            comp = {}
            for r in range(self.n_ranks):
                f = self.slow.get(r, 1.0) if s >= self.slow_from else 1.0
                comp[r] = base * f * rng.uniform(0.97, 1.03)
            dur = max(comp.values()) + 0.08 + rng.uniform(0, 0.02)
            ts += dur
            loss = 2.9 * math.exp(-s / 900) + 0.9 + rng.gauss(0, 0.03)
            for r in range(self.n_ranks):
                rec: dict[str, Any] = {"v": 1, "ts": round(ts + rng.uniform(0, 0.004), 6), "job": job, "rank": r,
                                       "node": self.node_of(r), "step": s, "duration_s": round(dur, 5), "n_seqs": n_seqs,
                                       "sum_len": sl, "sum_len_sq": sq, "tokens": sl}
                bad = self.nan_from is not None and s >= self.nan_from
                rec["loss"] = (self.nan_text or float("nan")) if bad else round(loss, 5)
                rec["grad_norm"] = float("inf") if bad else round(abs(rng.gauss(1.1, 0.15)), 4)
                if self.splits:
                    rec["fwd_s"] = round(comp[r] * 0.36, 5)
                    rec["bwd_s"] = round(comp[r] * 0.64, 5)
                    rec["comm_s"] = round(dur - comp[r], 5)
                key = {"node": self.node_of(r), "rank": f"rank_{r:05d}", "one": "train"}[layout]
                line = json.dumps(rec)  # Python writes NaN / Infinity literals, as real loggers do
                files.setdefault(key, []).append(line)
        for k, lines in files.items():
            (d / "steps" / f"{k}.jsonl").write_text("\n".join(lines) + "\n")
        return ts

    def _pause_lines(self, ts: float) -> None:
        """rank 0's torchtitan lines around a checkpoint save starting at ``ts`` (its own words)."""
        def stamp(t: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f",{int(t % 1 * 1000):03d}"
        node = self.node_of(0)
        self.nccl[node].append((0, f"[rank0]:{stamp(ts + 0.3)} - root - INFO - Saving the checkpoint (or staging if "
                                   "async is enabled)."))
        self.nccl[node].append((0, f"[rank0]:{stamp(ts + self.pause_s - 0.4)} - root - INFO - Finished saving the "
                                   f"checkpoint (or staging if async is enabled)in {self.pause_s - 0.7:.2f} seconds."))

    def _gpu(self, d: Path, last_ts: float) -> None:
        sc, rng = self.sc, self.rng
        end = max(last_ts, self.cum[-1]) + 30.0
        uuids = {(n, g): f"GPU-{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}-{rng.getrandbits(16):04x}-{rng.getrandbits(16):04x}-{rng.getrandbits(48):012x}"
                 for n in sc.nodes for g in range(sc.gpn)}
        strings = rng.random() < 0.6
        for node in sc.nodes:
            rows = []
            ts = self.t0 - rng.uniform(0, self.sample_s)
            while ts < end:
                gpus = []
                running = ts < last_ts or (self.busy_after_stop and ts < last_ts + 3600)
                for g in range(sc.gpn):
                    st: dict[str, Any] = {
                        "index": g, "uuid": uuids[(node, g)], "pci_bus": f"00000000:{self.bus(g).upper()}:00.0",
                        "util": rng.randint(93, 100) if running else 0,
                        "mem_used_mb": 71_000 + rng.randint(0, 2000) if running else 512,
                        "temp_c": rng.randint(58, 71) if running else 36, "power_w": round(rng.uniform(540, 690), 1) if running else 71.0,
                        "sm_clock_mhz": 1980 if running else 345, "throttle_reasons": 0, "ecc_sbe": 0, "ecc_dbe": 0,
                        "retired_pages": "N/A", "remap_pending": 0, "pcie_replay": 0, "nvlink_errors": 0,
                    }
                    for fn in self.gpu_mods:
                        fn(node, g, ts, st)
                    if st.get("_gone"):
                        continue
                    if strings:
                        for k, unit in (("temp_c", "C"), ("power_w", "W"), ("sm_clock_mhz", "MHz"), ("util", "%"), ("mem_used_mb", "MiB")):
                            if isinstance(st.get(k), (int, float)):
                                st[k] = f"{st[k]} {unit}"
                        st["throttle_reasons"] = f"0x{int(st['throttle_reasons']):016x}"
                    if strings and rng.random() < 0.1:
                        st[rng.choice(("retired_pages", "pcie_replay", "power_w"))] = rng.choice(("[N/A]", "[Not Supported]", "N/A"))
                    if rng.random() < 0.05:
                        st.pop(rng.choice(("power_w", "pcie_replay", "nvlink_errors", "retired_pages")), None)
                    gpus.append({k: v for k, v in st.items() if not k.startswith("_")})
                rows.append(json.dumps({"v": 1, "ts": round(ts, 3), "node": node, "gpus": gpus}))
                ts += self.sample_s
            (d / "nodes" / node).mkdir(parents=True, exist_ok=True)
            (d / "nodes" / node / "gpu.jsonl").write_text("\n".join(rows) + "\n")

    def _kernel(self, d: Path, last_ts: float) -> None:
        sc, rng = self.sc, self.rng
        for node in sc.nodes:
            ev = list(self.kernel[node])
            boot_ts = self.t0 - self.uptime0[node]
            # a few boot lines near the boot (only logs that keep that far back: dmesg); the rest at job start
            start = boot_ts + 2.0 if self.node_fmt.get(node, self.kfmt).startswith("dmesg") else self.t0 - 300
            for i, ln in enumerate(rng.sample(NOISE_BOOT, 9)):
                ev.append((start + i * 0.37, ln.format(nic=self.nic, bus=self.bus(rng.randrange(sc.gpn)))))
            t = self.t0
            while t < max(last_ts, self.cum[-1]) + 60:
                t += rng.uniform(20, 140)
                if rng.random() < 0.7:
                    ev.append((t, rng.choice(NOISE_RUN)))
                elif self.node_fmt.get(node, self.kfmt) in ("syslog", "syslog_uptime", "journal_iso", "journal_iso_tz", "rfc3339",
                                                            "short_precise", "syslog_local"):
                    prog, msg = rng.choice(NOISE_PROGRAMS)
                    ev.append((t, "\0" + prog + "\0" + msg))
            ev.sort(key=lambda x: x[0])
            out = []
            for ts, msg in ev:
                if msg.startswith("\0"):
                    _, prog, body = msg.split("\0")
                    out.append(self.kline(node, ts, body, prog))
                    continue
                first, *rest = msg.split("\n")
                out.append(self.kline(node, ts, first))
                out.extend(self.kline(node, ts, x) for x in rest)
            (d / "nodes" / node).mkdir(parents=True, exist_ok=True)
            (d / "nodes" / node / "kernel.log").write_text("\n".join(out) + "\n")

    def _nccl(self, d: Path) -> None:
        sc, rng = self.sc, self.rng
        style = rng.choice(("torchrun", "per_rank"))
        for ni, node in enumerate(sc.nodes):
            per: dict[int, list[str]] = {}
            for g in range(sc.gpn):
                r = ni * sc.gpn + g
                p = (r + 1) % self.n_ranks
                lines = []
                for c in rng.sample(NCCL_CHATTER, 8):
                    body = c.format(g=g, r=r, p=p, pg=p % sc.gpn, n=self.n_ranks, bus=self.bus(g))
                    lines.append(f"{node}:{self.pid[r]}:{self.pid[r] + rng.randint(50, 200)} [{g}] {body}")
                per[r] = lines
            for r, ln in self.nccl[node]:
                per.setdefault(r, []).append(ln)
            (d / "nodes" / node / "nccl").mkdir(parents=True, exist_ok=True)
            if style == "torchrun":
                text = []
                for r, lines in sorted(per.items()):
                    g = r % sc.gpn
                    text += [ln if ln.startswith("[rank") else f"[default{g}]:{ln}" for ln in lines]
                (d / "nodes" / node / "nccl" / "torchrun.log").write_text("\n".join(text) + "\n")
            else:
                for r, lines in per.items():
                    (d / "nodes" / node / "nccl" / f"rank{r}.log").write_text("\n".join(lines) + "\n")


def _pyspy(w: _Writer, rank: int, frames: list[str]) -> str:
    head = f"Process {w.pid[rank]}: /usr/bin/python3 -u /workspace/train.py --config configs/7b.yaml\nPython v3.10.12 (/usr/bin/python3.10)\n\n"
    main = f'Thread {w.pid[rank]} (active): "MainThread"\n' + "".join(f"    {f}\n" for f in frames)
    idle = f'Thread {w.pid[rank] + 41} (idle): "Thread-3 (_pin_memory_loop)"\n    select (selectors.py:416)\n    wait (multiprocessing/connection.py:931)\n    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:53)\n'
    return head + main + "\n" + idle


COMM_FRAMES = ["all_reduce (torch/distributed/distributed_c10d.py:2288)", "wrapper (torch/distributed/c10d_logger.py:83)",
               "reduce_gradients (megatron/core/distributed/param_and_grad_buffer.py:312)",
               "train_step (megatron/training/training.py:602)", "train (megatron/training/training.py:1011)",
               "pretrain (megatron/training/training.py:287)", "<module> (pretrain_gpt.py:243)"]
P2P_FRAMES = ["recv (torch/distributed/distributed_c10d.py:2127)", "_communicate (megatron/core/pipeline_parallel/p2p_communication.py:356)",
              "recv_forward (megatron/core/pipeline_parallel/p2p_communication.py:420)",
              "forward_backward_pipelining_without_interleaving (megatron/core/pipeline_parallel/schedules.py:1256)",
              "train_step (megatron/training/training.py:586)", "train (megatron/training/training.py:1011)",
              "pretrain (megatron/training/training.py:287)", "<module> (pretrain_gpt.py:243)"]
STUCK_FRAMES = (
    ["synchronize (torch/cuda/__init__.py:801)", "forward_backward_no_pipelining (megatron/core/pipeline_parallel/schedules.py:452)",
     "train_step (megatron/training/training.py:586)", "train (megatron/training/training.py:1011)",
     "pretrain (megatron/training/training.py:287)", "<module> (pretrain_gpt.py:243)"],
    ["read (megatron/core/datasets/indexed_dataset.py:221)", "__getitem__ (megatron/core/datasets/gpt_dataset.py:188)",
     "fetch (torch/utils/data/_utils/fetch.py:51)", "_next_data (torch/utils/data/dataloader.py:674)",
     "__next__ (torch/utils/data/dataloader.py:631)", "get_batch (pretrain_gpt.py:121)",
     "train_step (megatron/training/training.py:570)", "train (megatron/training/training.py:1011)",
     "pretrain (megatron/training/training.py:287)", "<module> (pretrain_gpt.py:243)"],
)


def _inject(w: _Writer) -> None:  # noqa: C901 - one branch per fault kind, each short
    sc, rng, kind = w.sc, w.rng, w.sc.kind
    nodes = sc.nodes
    cn = rng.randrange(len(nodes))
    node = nodes[cn]
    g = rng.randrange(sc.gpn)
    rank = cn * sc.gpn + g
    fault_step = rng.randint(140, 240)
    ft = w.at(fault_step)
    others = [r for r in range(w.n_ranks) if r != rank]
    one = (node,)
    evict_or_diag = (("evict_nodes", one), ("run_diagnostics", one))
    T = Truth
    if kind == "healthy":
        # benign look-alikes only: a recovered correctable AER, an informational Xid 63 on a random node
        if rng.random() < 0.5:
            w.kernel[node].append((ft, w.xid(g, 63, "pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.").replace("pid='<unknown>', name=<unknown>, pid=1896, ", "pid=1896, ")))
        sc.truth = T(nothing=True, text="nothing")
    elif kind == "ckpt_pause":
        # A torchtitan checkpoint save of 5-15 minutes: every rank stops stepping, GPUs keep their memory,
        # and the framework says when it starts and when it is done (its own words, tests/fixtures/pauses).
        w.pause_step, w.pause_s = fault_step, rng.uniform(300.0, 900.0)  # the lines: _Writer._pause_lines
        w.cum[fault_step + 2:] = [t + w.pause_s for t in w.cum[fault_step + 2:]]
        sc.truth = T(nothing=True, text="nothing (a checkpoint save)")
    elif kind == "xid79":
        w.stop_step = fault_step
        if w.hard and rng.random() < 0.5:  # the probe-time block with no Xid line (real-logs k002)
            w.kernel[node].append((ft, f"NVRM: The NVIDIA GPU 0000:{w.bus(g)}:00.0\n               NVRM: (PCI ID: 10de:20b2) installed in this system has\n               NVRM: fallen off the bus and is not responding to commands."))
        else:
            w.kernel[node].append((ft, w.xid(g, 79, "GPU has fallen off the bus.")))
        if w.hard:
            w.kernel[node].append((ft + 0.4, w.xid(g, 154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")))
        if rng.random() < 0.5:
            w.kernel[node].append((ft + 0.01, f"NVRM: GPU 0000:{w.bus(g)}:00.0: GPU has fallen off the bus."))
        w.gpu_mod(lambda n, i, ts, st: st.update(_gone=True) if n == node and i == g and ts > ft else None)
        w.watchdogs(ft + 600, others, 9000 + fault_step)
        sc.truth = T(culprits=one, any_of=(("evict_nodes", one),), text=f"evict {node}")
    elif kind == "xid48_watchdog":
        w.stop_step = fault_step
        w.kernel[node].append((ft, w.xid(g, 48, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.", w.pid[rank])))
        if rng.random() < 0.5:
            w.kernel[node].append((ft + 0.2, w.xid(g, 63, "Row Remapper: New row marked for remapping, reset gpu to activate.", w.pid[rank])))
        w.gpu_mod(lambda n, i, ts, st: st.update(ecc_dbe=2, remap_pending=1) if n == node and i == g and ts > ft else None)
        if w.hard:
            w.kernel[node].append((ft + 0.5, w.xid(g, 154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")))
            w.kernel[node].append((ft + 1.5, w.xid(g, 45, "Ch 00000010", w.pid[rank])))
        w.watchdogs(ft + 600 + rng.uniform(0, 5), list(range(w.n_ranks)), 5000 + fault_step)
        sc.truth = T(culprits=one, any_of=evict_or_diag, text=f"evict {node}")
    elif kind == "late_watchdog":
        # A machine fault and, a whole timeout later (PyTorch's default 30 min, or NCCL_TIMEOUT-style 10 min),
        # every rank's watchdog naming that timeout: the stall began at the fault (tests/fixtures/late_symptoms).
        # The Xid's own incident is the verdict; the late watchdog must not open a second one with its restart.
        w.stop_step = fault_step
        code, timeout_s = rng.choice((48, 79, 94)), rng.choice((1800, 1800, 600))
        text = {48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
                79: "GPU has fallen off the bus.", 94: "Contained ECC error."}[code]
        w.kernel[node].append((ft, w.xid(g, code, text, w.pid[rank] if code != 79 else None)))
        if code == 79:
            w.gpu_mod(lambda n, i, ts, st: st.update(_gone=True) if n == node and i == g and ts > ft else None)
        else:
            w.gpu_mod(lambda n, i, ts, st: st.update(ecc_dbe=1) if n == node and i == g and ts > ft else None)
        w.watchdogs(ft + timeout_s + rng.uniform(0.5, 3.0), list(range(w.n_ranks)), 6000 + fault_step, timeout_s)
        acc = (("evict_nodes", one),) if code == 79 else evict_or_diag if code == 48 else \
            (("restart_job", None), *evict_or_diag)
        sc.truth = T(culprits=one, any_of=acc, text=f"{'evict' if code == 79 else 'evict / diag / restart'} {node}"
                     f" (Xid {code}, watchdog {timeout_s // 60} min later)")
    elif kind in ("xid94", "xid95"):
        w.stop_step = fault_step
        code = 94 if kind == "xid94" else 95
        text = "Contained ECC error." if code == 94 else "Uncontained ECC error."
        w.kernel[node].append((ft, w.xid(g, code, text, w.pid[rank])))
        w.gpu_mod(lambda n, i, ts, st: st.update(ecc_dbe=1) if n == node and i == g and ts > ft else None)
        w.traceback([rank], ["RuntimeError: CUDA error: uncorrectable ECC error encountered",
                             "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect."])
        acc = (("restart_job", None), *evict_or_diag) if code == 94 else evict_or_diag + (("restart_job", None),)
        sc.truth = T(culprits=one, any_of=acc, text=f"{'restart' if code == 94 else 'evict'} / diag {node}")
    elif kind == "xid64_remap":
        w.stop_step = fault_step if rng.random() < 0.5 else None
        w.kernel[node].append((ft, w.xid(g, 64, "Failed to persist row remap table — GPU may require servicing")))
        w.gpu_mod(lambda n, i, ts, st: st.update(remap_failure="Yes", remap_pending=1) if n == node and i == g and ts > ft else None)
        sc.truth = T(culprits=one, any_of=(("evict_nodes", one),), text=f"evict {node}")
    elif kind == "xid_user":
        w.stop_step = fault_step
        hit = [node] if rng.random() < 0.4 else nodes
        for hn in hit:
            hi = nodes.index(hn)
            for gg in range(sc.gpn):
                r = hi * sc.gpn + gg
                code = rng.choice((13, 31, 43))
                msg = {13: "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
                       31: "Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x7f1c_d8000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
                       43: "Ch 00000008"}[code]
                w.kernel[hn].append((ft + gg * 0.01, w.xid(gg, code, msg, w.pid[r], "pt_main_thread")))
        w.traceback(list(range(w.n_ranks)) if len(hit) > 1 else [cn * sc.gpn + x for x in range(sc.gpn)],
                    ["RuntimeError: CUDA error: an illegal memory access was encountered",
                     "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."])
        sc.truth = T(culprits=(), job_level=True, any_of=(("restart_job", None), ("rollback_code", None)),
                     forbid=("evict_nodes",), text="restart / rollback, no eviction")
    elif kind == "xid74_nvlink":
        w.stop_step = fault_step
        w.kernel[node].append((ft, w.xid(g, 74, "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", w.pid[rank])))
        w.gpu_mod(lambda n, i, ts, st: st.update(nvlink_errors=17) if n == node and i == g and ts > ft else None)
        w.watchdogs(ft + 600, others, 7000 + fault_step)
        sc.truth = T(culprits=one, any_of=evict_or_diag + (("restart_job", None),), text=f"evict / diag {node}")
    elif kind == "ib_flap":
        port = rng.randint(0, 3)
        w.kernel[node].append((ft, f"mlx5_core 0000:{w.nic}:00.{port} mlx5_{port}: Port: 1 Link DOWN"))
        w.kernel[node].append((ft + rng.uniform(2, 6), f"mlx5_core 0000:{w.nic}:00.{port} mlx5_{port}: Port: 1 Link ACTIVE"))
        sc.truth = T(culprits=one, nothing=True, text="nothing (recovered flap)")
    elif kind == "ib_down":
        w.stop_step = fault_step + 3
        port = rng.randint(0, 3)
        for k in range(rng.randint(3, 5)):
            t = ft + k * rng.uniform(20, 50)
            w.kernel[node].append((t, f"mlx5_core 0000:{w.nic}:00.{port} mlx5_{port}: Port: 1 Link DOWN"))
            w.kernel[node].append((t + 0.3, f"mlx5_core 0000:{w.nic}:00.{port} ibp{w.nic}s0f{port}: Link down"))
        peers = [cn * sc.gpn + gg for gg in range(sc.gpn)]
        if w.hard:  # the remote side of each broken connection complains too
            peers += [r for r in range(w.n_ranks) if r // sc.gpn != cn and rng.random() < 0.3]
        for r in peers:
            gg = r % sc.gpn
            w.nccl[w.node_of(r)].append((r, f"{w.node_of(r)}:{w.pid[r]}:{w.pid[r] + 77} [{gg}] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.3.{rng.randint(2, 250)}<42118> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.3.7 remoteGidsfe80::a088:c203:a1:f3c2 hca mlx5_{port}"))
        sc.truth = T(culprits=one, any_of=evict_or_diag, text=f"evict {node}")
    elif kind == "thermal":
        w.slow, w.slow_from = {rank: rng.uniform(1.35, 1.8)}, fault_step
        w.gpu_mod(lambda n, i, ts, st: st.update(temp_c=rng.randint(88, 94), sm_clock_mhz=rng.choice((1110, 1185, 1245)),
                                                  throttle_reasons=0x48 if rng.random() < 0.5 else 0x20, power_w=round(rng.uniform(380, 420), 1))
                  if n == node and i == g and ts > ft else None)
        sc.truth = T(culprits=one, any_of=(("adapt_parallelism", one),) + evict_or_diag, text=f"adapt / evict {node}")
    elif kind == "slow_gpu":
        w.splits = True
        w.slow, w.slow_from = {rank: rng.uniform(1.2, 1.35) if w.hard else rng.uniform(1.3, 1.7)}, fault_step
        sc.truth = T(culprits=one, any_of=(("adapt_parallelism", one),) + evict_or_diag, text=f"adapt / evict {node}")
    elif kind == "hang":
        w.stop_step = fault_step
        w.busy_after_stop = True
        stuck = rng.choice(STUCK_FRAMES)
        variant = rng.choice(("plain", "p2p", "two_stuck", "no_answer")) if w.hard else "plain"
        variant = sc.force.get("hang_variant", variant)
        stuck_ranks = {rank}
        if variant == "two_stuck":
            stuck_ranks.add(cn * sc.gpn + (g + 1) % sc.gpn)
        frames = {r: stuck if r in stuck_ranks else COMM_FRAMES for r in range(w.n_ranks)}
        if variant == "p2p" and w.pp == 2:  # the stuck stage's pipeline peers wait in p2p, not in the all-reduce
            span = sc.gpn * (len(nodes) // 2)
            for r in (rank - span, rank + span):
                if 0 <= r < w.n_ranks:
                    frames[r] = P2P_FRAMES
        w.stacks = {r: _pyspy(w, r, f) for r, f in frames.items()}
        if variant == "no_answer":  # the stuck machine never answered the dump
            for gg in range(sc.gpn):
                w.stacks.pop(cn * sc.gpn + gg, None)
        elif w.hard:  # a few other ranks did not answer the dump
            for r in sc.force.get("drop", rng.sample(others, min(3, len(others)))):
                w.stacks.pop(r, None)
        if rng.random() < 0.5:
            w.watchdogs(ft + 600, [r for r in others if r not in stuck_ranks], 3000 + fault_step)
        acc: tuple[tuple[str, tuple[str, ...] | None], ...] = (("evict_nodes", one), ("run_diagnostics", one))
        if variant == "no_answer":
            acc += (("restart_job", None),)
        sc.truth = T(culprits=one, any_of=acc, text=f"evict {node} (stuck rank {rank}, {variant})")
    elif kind == "user_exception":
        w.stop_step = fault_step
        if w.hard and rng.random() < 0.4:  # one rank runs out of GPU memory on a long batch; the rest time out
            w.traceback([rank], [f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.22 GiB. GPU {g} has a total capacity of 79.10 GiB of which 3.71 GiB is free. Including non-PyTorch memory, this process has 75.38 GiB memory in use. Of the allocated memory 71.02 GiB is allocated by PyTorch, and 2.91 GiB is reserved by PyTorch but unallocated."])
            w.watchdogs(ft + 600, others, 6000 + fault_step)
            sc.truth = T(job_level=True, any_of=(("rollback_code", None), ("restart_job", None)), forbid=("evict_nodes",),
                         text="rollback / restart (CUDA OOM)")
            return
        exc = rng.choice((["KeyError: 'attention_mask'"],
                          ["RuntimeError: The size of tensor a (4096) must match the size of tensor b (8192) at non-singleton dimension 1"],
                          ["ValueError: Expected input batch_size (16) to match target batch_size (32)."]))
        if w.hard:  # torchrun tears the rest down: one traceback per node, then the elastic summary
            w.traceback([i * sc.gpn for i in range(len(nodes))], exc)
            for i, hn in enumerate(nodes):
                w.nccl[hn].append((i * sc.gpn, f"E1127 10:12:0{i % 10}.{rng.randint(100000, 999999)} {w.pid[i * sc.gpn]} torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1) local_rank: 0 (pid: {w.pid[i * sc.gpn]}) of binary: /usr/bin/python3"))
                w.nccl[hn].append((i * sc.gpn, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "))
        else:
            w.traceback(list(range(w.n_ranks)), exc)
        sc.truth = T(job_level=True, any_of=(("rollback_code", None),), forbid=("evict_nodes",), text="rollback")
    elif kind == "nan_loss":
        w.nan_from = fault_step
        w.stop_step = fault_step + rng.randint(5, 30)
        sc.truth = T(job_level=True, any_of=(("rollback_code", None), ("restart_job", None), ("run_diagnostics", None)),
                     forbid=("evict_nodes",), text="rollback / restart / diag, no eviction")
    elif kind == "oom_killer":
        w.stop_step = fault_step
        vic = w.pid[rank]
        if w.hard:  # the container's memory cgroup, not the host, ran out (real-logs host-002 / host-039 shapes)
            w.kernel[node].append((ft - 0.1, f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=cri-containerd-3fc28fa1c647ceede9f6b340d0b,mems_allowed=0-1,oom_memcg=/kubepods/burstable/pod1d5c6a05,task_memcg=/kubepods/burstable/pod1d5c6a05/3fc28fa1c647,task=python3,pid={vic},uid=0"))
            w.kernel[node].append((ft, f"Memory cgroup out of memory: Killed process {vic} (python3) total-vm:155518724kB, anon-rss:123902876kB, file-rss:154436kB, shmem-rss:0kB, UID:0 pgtables:251344kB oom_score_adj:-997"))
            w.watchdogs(ft + 600, others, 2000 + fault_step)
            sc.truth = T(job_level=True, culprits=(), any_of=(("restart_job", None), ("rollback_code", None)),
                         forbid=("evict_nodes",), text="restart, no eviction")
            return
        w.kernel[node].append((ft - 0.2, "python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0"))
        w.kernel[node].append((ft - 0.1, f"oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,task_memcg=/user.slice/user-1000.slice/session-4211.scope,task=python3,pid={vic},uid=1000"))
        w.kernel[node].append((ft, f"Out of memory: Killed process {vic} (python3) total-vm:155518724kB, anon-rss:123902876kB, file-rss:154436kB, shmem-rss:0kB, UID:1000 pgtables:251344kB oom_score_adj:0"))
        w.watchdogs(ft + 600, others, 2000 + fault_step)
        sc.truth = T(job_level=True, culprits=(), any_of=(("restart_job", None), ("rollback_code", None)),
                     forbid=("evict_nodes",), text="restart, no eviction")
    elif kind == "storage_stall":
        w.stop_step = fault_step
        srv = f"10.0.{rng.randint(0, 9)}.{rng.randint(2, 250)}"
        for hn in nodes:
            t = ft + rng.uniform(5, 30)
            w.kernel[hn].append((t, f"nfs: server {srv} not responding, still trying"))
            if w.hard:
                w.kernel[hn].append((t + rng.uniform(200, 400), f"nfs: server {srv} OK"))
                if rng.random() < 0.4:
                    continue
            w.kernel[hn].append((t + 120, f"INFO: task python3:{rng.randint(30000, 60000)} blocked for more than 120 seconds.\n      Tainted: P           OE     6.2.0-37-generic #38~22.04.1-Ubuntu\n\"echo 0 > /proc/sys/kernel/hung_task_timeout_secs\" disables this message."))
        sc.truth = T(job_level=True, any_of=(("notify", None),), forbid=("evict_nodes", "run_diagnostics"), text="job-wide notify")
    elif kind == "pcie_aer_fatal":
        w.stop_step = fault_step
        b = w.bus(g)
        w.kernel[node].append((ft, f"pcieport 0000:{int(b, 16) - 1:02x}:00.0: AER: Uncorrected (Fatal) error received: 0000:{b}:00.0"))
        w.kernel[node].append((ft + 0.001, f"nvidia 0000:{b}:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)"))
        w.kernel[node].append((ft + 0.002, f"nvidia 0000:{b}:00.0: AER: can't recover (no error_detected callback)"))
        w.gpu_mod(lambda n, i, ts, st: st.update(_gone=True) if n == node and i == g and ts > ft + 1 else None)
        w.watchdogs(ft + 600, others, 4000 + fault_step)
        sc.truth = T(culprits=one, any_of=(("evict_nodes", one),), text=f"evict {node}")
    elif kind == "sxid_fatal":
        w.stop_step = fault_step
        sw = rng.randint(0, 3)
        w.kernel[node].append((ft, f"nvidia-nvswitch{sw}: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link {rng.randint(0, 63)} LTSSM Fault Up"))
        w.kernel[node].append((ft + 0.001, f"nvidia-nvswitch{sw}: SXid (PCI:0000:c3:00.0): 20034, Severity 1 Engine instance 60 Sub-engine instance 00"))
        w.kernel[node].append((ft + 0.002, f"nvidia-nvswitch{sw}: SXid (PCI:0000:c3:00.0): 20034, Data {{0x10000000, 0x10000000, 0x00000000, 0x10000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}}"))
        w.watchdogs(ft + 600, others, 8000 + fault_step)
        sc.truth = T(culprits=one, any_of=evict_or_diag, text=f"evict {node} (NVSwitch fatal)")
    elif kind == "xid154_recovery":
        # NVIDIA's stated recovery for the GPU (Xid 154, R570+ drivers; NVML's GPU recovery action field too) right
        # after the Xid that caused it. The GPU stays in the NVML samples: only the driver's word says "reboot".
        w.stop_step = fault_step
        root, root_text = rng.choice((
            (109, "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005"),
            (119, "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20803039 0x8)."),
            (120, "GSP task timeout @ pc:0x4bd7364, task: 1"),
            (62, "323f0f30 0000c3d8 00000000 206dae68 206da022 206da190 206d85f6 206d8d86")))
        code, wording = rng.choice(((2, "Node Reboot Required"), (4, "Drain and Reset"), (1, "GPU Reset Required")))
        w.kernel[node].append((ft, w.xid(g, root, root_text, w.pid[rank], "pt_main_thread")))
        w.kernel[node].append((ft + 0.3, w.xid(g, 154, f"GPU recovery action changed from 0x0 (None) to 0x{code:x} ({wording})")))
        if rng.random() < 0.5:
            w.kernel[node].append((ft + 1.2, w.xid(g, 45, "Ch 00000008", w.pid[rank], "pt_main_thread")))
        if rng.random() < 0.5:  # an agent that reads NVML's field writes it into the sample
            w.gpu_mod(lambda n, i, ts, st: st.update(recovery_action=code) if n == node and i == g and ts > ft else None)
        w.watchdogs(ft + 600, others, 9500 + fault_step)
        if code == 1:
            sc.truth = T(culprits=one, any_of=(("run_diagnostics", one),), forbid=("rollback_code",),
                         text=f"reset + diag {node} (Xid {root} then 154 GPU Reset Required)")
        else:
            sc.truth = T(culprits=one, any_of=(("evict_nodes", one),),
                         text=f"evict {node} (Xid {root} then 154 {wording})")
    elif kind == "xid_app_traceback":
        # Application Xids (13, 31, 43; 45 as their cleanup) with the ranks' CUDA errors: the code, never the
        # machine. Xid 43 alone (a channel reset after the user's kernel faulted) is the usual sight.
        w.stop_step = fault_step
        codes = rng.choice(((43,), (43, 45), (13, 43), (31, 45)))
        msg = {13: "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
               31: "Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x7f1c_d8000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
               43: "Ch 00000008", 45: "Ch 00000010"}
        hit = [node] if rng.random() < 0.5 else nodes
        for hn in hit:
            hi = nodes.index(hn)
            for gg in range(sc.gpn):
                r = hi * sc.gpn + gg
                for k, c in enumerate(codes):
                    w.kernel[hn].append((ft + gg * 0.01 + k * 0.4, w.xid(gg, c, msg[c], w.pid[r], "pt_main_thread")))
        err = rng.choice(("RuntimeError: CUDA error: an illegal memory access was encountered",
                          "RuntimeError: CUDA error: misaligned address",
                          "RuntimeError: CUDA error: an illegal instruction was encountered",
                          "RuntimeError: CUDA error: unspecified launch failure"))
        ranks = [r for r in range(w.n_ranks) if w.node_of(r) in hit]
        w.traceback(ranks if w.hard else ranks[:: sc.gpn], [err, "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
                                                           "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"])
        sc.truth = T(culprits=(), job_level=True, any_of=(("rollback_code", None), ("restart_job", None)),
                     forbid=("evict_nodes",), text=f"rollback / restart (Xid {'/'.join(map(str, codes))} + {err.split(': ')[-1]})")
    elif kind == "cuda_unknown_failing_gpu":
        # One rank dies with "CUDA error: unknown error" while its GPU is failing: the machine, not the code.
        w.stop_step = fault_step
        evidence = rng.choice(("xid79", "dbe", "xid119"))
        if evidence == "xid79":
            w.kernel[node].append((ft, w.xid(g, 79, "GPU has fallen off the bus.")))
            w.gpu_mod(lambda n, i, ts, st: st.update(_gone=True) if n == node and i == g and ts > ft else None)
        elif evidence == "dbe":
            w.gpu_mod(lambda n, i, ts, st: st.update(ecc_dbe=2, remap_pending=1) if n == node and i == g and ts > ft - 5 else None)
        else:
            w.kernel[node].append((ft, w.xid(g, 119, "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20803039 0x8).", w.pid[rank], "pt_main_thread")))
        w.traceback([rank], ["RuntimeError: CUDA error: unknown error",
                             "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
                             "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"])
        w.watchdogs(ft + 600, others, 9700 + fault_step)
        sc.truth = T(culprits=one, any_of=evict_or_diag, forbid=("rollback_code",),
                     text=f"evict / diag {node} (unknown error + {evidence})")
    else:
        raise ValueError(f"unknown kind {kind}")
    if w.hard and len(nodes) > 1:
        at = rng.uniform(w.t0 + 60, ft + 200)
        _distract(w, rng.choice([n for n in nodes if n != node]), ft + 30 if sc.force.get("distract_at") == "fault" else at)


def _distract(w: _Writer, node: str, t: float) -> None:
    """Benign look-alikes on a healthy node: each real, each nothing to act on."""
    rng, g = w.rng, w.rng.randrange(w.sc.gpn)
    pick = rng.choice(("flap", "aer_ce", "xid63", "peermem", "cpu_thermal", "edac_ce", "nfs_blip", "sbe", "sxid_nonfatal"))
    pick = w.sc.force.get("distract", pick)
    port = rng.randint(0, 3)
    lines = {
        "flap": [f"mlx5_core 0000:{w.nic}:00.{port} mlx5_{port}: Port: 1 Link DOWN", f"mlx5_core 0000:{w.nic}:00.{port} mlx5_{port}: Port: 1 Link ACTIVE"],
        "aer_ce": ["pcieport 0000:00:03.0: AER: Corrected error received: 0000:00:03.0",
                   "pcieport 0000:00:03.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)"] * 3,
        "xid63": [w.xid(g, 63, "Row Remapper: New row marked for remapping, reset gpu to activate.", 1896)],
        "peermem": ["nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping further processing"],
        "cpu_thermal": ["mce: CPU2: Core temperature above threshold, cpu clock throttled (total events = 2675)",
                        "mce: CPU2: Core temperature/speed normal"],
        "edac_ce": ["EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#2_DIMM#0 (channel:2 slot:0 page:0x849923 offset:0x380 grain:32 syndrome:0x0 - area:DRAM err_code:0001:0092 socket:0 ha:0 channel_mask:4 rank:1)"],
        "nfs_blip": ["nfs: server 10.0.0.5 not responding, still trying", "nfs: server 10.0.0.5 OK"],
        "sbe": [],
        "sxid_nonfatal": ["nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Link 04 RX Short Error Rate"],
    }[pick]
    for i, ln in enumerate(lines):
        w.kernel[node].append((t + i * rng.uniform(0.5, 4), ln))
    if pick == "sbe":
        w.gpu_mod(lambda n, i, ts, st: st.update(ecc_sbe=1 + int(ts - t) // 120) if n == node and i == g and ts > t else None)


def node_names(rng: random.Random, n: int) -> list[str]:
    """Node names in one of several real naming schemes."""
    style = rng.choice(("a100", "ip", "dgx", "fqdn"))
    base = rng.randint(1, 200)
    if style == "a100":
        return [f"gpu-a100-{base + i:03d}" for i in range(n)]
    if style == "ip":
        return [f"10-0-{(base + i) // 250}-{(base + i) % 250 + 2}" for i in range(n)]
    if style == "dgx":
        return [f"dgx-h100-r{3 + i // 8:02d}u{(i % 8) * 4 + 2:02d}" for i in range(n)]
    return [f"node{base + i:04d}.cluster.internal" for i in range(n)]


def scenarios(count: int, seed0: int = 1, force: dict[str, Any] | None = None) -> list[Scenario]:
    """``count`` scenarios cycling over every kind, sizes 2-16 nodes, 4 or 8 GPUs per node (``force``
    pins choices in all of them, e.g. ``{"hard": True}``)."""
    out = []
    for i in range(count):
        seed = seed0 + i
        rng = random.Random(seed)
        kind = KINDS[i % len(KINDS)]
        n = rng.choice((2, 3, 4, 4, 6, 8, 8, 12, 16))
        gpn = rng.choice((4, 8, 8))
        out.append(Scenario(name=f"{kind}-s{seed}", kind=kind, seed=seed, nodes=node_names(rng, n), gpn=gpn,
                            force=dict(force or {})))
    return out


def write(sc: Scenario, d: Path) -> Path:
    """Write ``sc`` as a batch directory at ``d``; sets ``sc.truth``."""
    return _Writer(sc, d).write()
