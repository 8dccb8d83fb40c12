"""Benchmark: the node agent's CPU and memory at 1 Hz NVML with 8 GPUs and 1,000 log lines/s.

The agent runs in its own process (a fake 8-GPU NVML backend, kernel + NCCL file
followers, delivery to an embedded broker). This script appends real-shaped kernel
and NCCL lines to its logs at the requested rate and reads the agent's CPU time
(/proc/<pid>/stat utime+stime) over the measured window and its peak RSS (VmHWM).
The line mix is a busy node's: ordinary kernel/NCCL noise plus a few recognised
lines a second (Xid, link down, a hung task with its call trace, NCCL WARN IB errors).
Both agent modes are measured: the default (ordinary lines counted, not shipped)
and ``agent.ship_ordinary_lines = true``. Targets: <= 0.5% of one core, <= 60 MB RSS.

    python benchmarks/agent_overhead.py [--quick] [--seconds 45] [--rate 1000] [--mode both|default|ship]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNEL = [
    "[{t:12.6f}] audit: type=1400 audit({i}:2): apparmor=\"STATUS\" operation=\"profile_replace\" profile=\"unconfined\" name=\"snap.lxd\" pid={p}",
    "[{t:12.6f}] IPv4: martian source 10.0.3.{p} from 10.0.0.1, on dev eth0",
    "[{t:12.6f}] docker0: port 1(veth{p}) entered forwarding state",
    "[{t:12.6f}] perf: interrupt took too long (2503 > 2500), lowering kernel.perf_event_max_sample_rate to 79750",
]
NCCL = [
    "gpu-n1:{p}:{p} [3] NCCL INFO Channel 02/0 : 3[3] -> 4[4] via P2P/IPC/read",
    "gpu-n1:{p}:{p} [3] NCCL INFO comm 0x55d4c0a0 rank 3 nranks 64 cudaDev 3 nvmlDev 3 busId 3b000 commId 0x1 - Init COMPLETE",
    "[rank3]:[W1121 10:00:00.000000000 ProcessGroupNCCL.cpp:4561] Warning: barrier() using device under current context",
]
KERNEL_SIGNALS = [
    "[{t:12.6f}] NVRM: Xid (PCI:0000:3b:00): 13, pid={p}, name=python, Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    "[{t:12.6f}] mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link DOWN",
    "[{t:12.6f}] INFO: task python:{p} blocked for more than 122 seconds.\n[{t:12.6f}] Call Trace:\n"
    "[{t:12.6f}]  __schedule+0x2cb/0x750\n[{t:12.6f}]  schedule+0x4e/0xc0",
]
NCCL_SIGNALS = [
    "gpu-n1:{p}:{p} [3] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer 10.0.0.7<52318> with status=12 opcode=0",
]
SIGNAL_P = 0.006  # ~6 recognised lines per second at 1,000 lines/s


def child(args: argparse.Namespace) -> None:
    """The agent process."""
    import logging

    from faultlens.collectors.agent import Agent
    from faultlens.config import AgentConfig, BusConfig, Config
    from faultlens.schema import GpuState

    class EightGpus:
        def open(self) -> None:
            pass

        def device_count(self) -> int:
            return 8

        def read(self) -> list[GpuState]:
            return [GpuState(index=i, uuid=f"GPU-{i:08x}", pci_bus=f"00000000:{0x19 + i:02X}:00.0", util=97.0, mem_used_mb=71000.0,
                             temp_c=61.0, power_w=650.0, sm_clock_mhz=1980.0, mem_clock_mhz=2619.0) for i in range(8)]

        def wait_events(self, timeout_s: float) -> list:
            time.sleep(timeout_s)
            return []

        def close(self) -> None:
            pass

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    cfg = Config(bus=BusConfig(bootstrap_servers=args.bootstrap, topic_prefix="bench"),
                 agent=AgentConfig(spool_dir=args.spool, nvml_interval_s=1.0, health_interval_s=3600,
                                   ship_ordinary_lines=args.mode == "ship"))
    agent = Agent(cfg, bootstrap=args.bootstrap, node="gpu-n1", nvml_backend=EightGpus(), kernel_source=args.kernel,
                  nccl_glob=args.nccl, sources=("nvml", "kernel", "nccl"), tick_s=args.tick)
    print("ready", flush=True)
    if os.environ.get("FAULTLENS_BENCH_THREADS"):  # CPU of the loop's parts
        spent: dict[str, float] = {}

        def timed(name: str, fn):  # noqa: ANN001, ANN202
            def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
                t = time.thread_time()
                try:
                    return fn(*a, **k)
                finally:
                    spent[name] = spent.get(name, 0.0) + time.thread_time() - t
            return wrapper

        agent.tick = timed("tick", agent.tick)
        if hasattr(agent, "_wait"):
            agent._wait = timed("wait", agent._wait)
        agent.delivery.pump = timed("pump", agent.delivery.pump)
        import atexit

        atexit.register(lambda: print("spent", {k: round(v, 3) for k, v in spent.items()}, file=sys.stderr))
    if os.environ.get("FAULTLENS_BENCH_PROFILE"):  # where the agent's CPU goes (cProfile stats to this file)
        import cProfile

        prof = cProfile.Profile()
        rep = prof.runcall(agent.run_for, args.seconds)
        prof.dump_stats(os.environ["FAULTLENS_BENCH_PROFILE"])
    else:
        rep = agent.run_for(args.seconds)
    print(json.dumps({"sent": rep["sent"], "requests": rep.get("send_requests"), "ticks": rep.get("ticks"), "spooled": rep["spool"]["records_spooled"],
                      "kernel_lines": rep["sources"]["kernel"]["lines"], "nccl_lines": rep["sources"]["nccl"]["lines"],
                      "ordinary": sum(s.get("ordinary_lines", 0) for s in rep["sources"].values())}), flush=True)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_s_path(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def measure(args: argparse.Namespace, mode: str, seconds: float) -> dict:
    """Run the agent in ``mode`` (default | ship) while writing lines; CPU and memory figures."""
    warmup = 5.0
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    rnd = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        kern = Path(tmp) / "kern.log"
        nccl = Path(tmp) / "nccl-rank3.log"
        kern.write_text("")
        nccl.write_text("")
        cmd = [sys.executable, __file__, "--child", "--bootstrap", broker.bootstrap, "--spool", str(Path(tmp) / "spool"),
               "--kernel", str(kern), "--nccl", str(nccl), "--seconds", str(seconds + warmup + 2), "--mode", mode]
        if args.tick is not None:
            cmd += ["--tick", str(args.tick)]
        from faultlens import lifeline

        proc = lifeline.spawn(cmd, stdout=subprocess.PIPE, text=True)  # dies with this script
        assert proc.stdout is not None
        proc.stdout.readline()  # "ready": imports done
        t_start = time.monotonic()
        rss_after_import = _status_kb(proc.pid, "VmRSS")
        written = signals = 0
        t = 1000.0
        cpu0 = None
        measured_from = t_start + warmup
        period = 0.1
        next_t = t_start
        w0 = t_start
        while time.monotonic() < measured_from + seconds:
            if cpu0 is None and time.monotonic() >= measured_from:
                cpu0 = _cpu_s(proc.pid)
                w0 = time.monotonic()
            n = int(args.rate * period)
            kl, nl = [], []
            for _ in range(n):
                t += 0.001
                p = rnd.randint(100, 99999)
                sig = rnd.random() < SIGNAL_P
                signals += sig
                if rnd.random() < 0.7:
                    kl.append((rnd.choice(KERNEL_SIGNALS) if sig else rnd.choice(KERNEL)).format(t=t, p=p, i=int(t)))
                else:
                    nl.append((rnd.choice(NCCL_SIGNALS) if sig else rnd.choice(NCCL)).format(p=p))
            with open(kern, "a") as f:
                f.write("\n".join(kl) + "\n")
            with open(nccl, "a") as f:
                f.write("\n".join(nl) + "\n")
            written += n
            next_t += period
            time.sleep(max(0.0, next_t - time.monotonic()))
        cpu1 = _cpu_s(proc.pid)
        wall = time.monotonic() - w0
        if os.environ.get("FAULTLENS_BENCH_THREADS"):  # CPU seconds per thread of the agent
            for task in sorted(Path(f"/proc/{proc.pid}/task").iterdir()):
                print("thread", task.name, (task / "comm").read_text().strip(), round(_cpu_s_path(task / "stat"), 2),
                      file=sys.stderr)
        hwm = _status_kb(proc.pid, "VmHWM")
        out, _ = proc.communicate(timeout=60)
    res = json.loads(out.strip().splitlines()[-1])
    return {"mode": mode, "wall": wall, "lines_per_s": written / (time.monotonic() - t_start), "signals": signals,
            "cpu_pct": 100.0 * ((cpu1 - (cpu0 or 0.0)) / wall), "rss_mb": hwm / 1024, "rss_import_mb": rss_after_import / 1024,
            **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 s instead of 45 s per mode")
    ap.add_argument("--smoke", action="store_true", help="2 s, default mode only (seconds): does it still run")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--rate", type=float, default=1000.0, help="log lines per second (70%% kernel, 30%% NCCL)")
    ap.add_argument("--tick", type=float, default=None, help="agent loop interval (s; default: agent.tick_s)")
    ap.add_argument("--mode", choices=["both", "default", "ship"], default="both",
                    help="default: ordinary lines counted; ship: agent.ship_ordinary_lines = true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", help=argparse.SUPPRESS)
    ap.add_argument("--spool", help=argparse.SUPPRESS)
    ap.add_argument("--kernel", help=argparse.SUPPRESS)
    ap.add_argument("--nccl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    seconds = args.seconds or (2.0 if args.smoke else 20.0 if args.quick else 45.0)
    modes = ["default", "ship"] if args.mode == "both" and not args.smoke else [args.mode if args.mode != "both" else "default"]
    results = [measure(args, m, seconds) for m in modes]
    print(f"{'figure':<40}" + "".join(f"{r['mode']:>14}" for r in results))
    rows = [("measured window (s)", "wall", "{:.1f}"), ("log lines written / s", "lines_per_s", "{:.0f}"),
            ("recognised lines written", "signals", "{:,}"),
            ("agent CPU (% of one core)  target 0.5", "cpu_pct", "{:.2f}"),
            ("agent peak RSS VmHWM (MB)  target 60", "rss_mb", "{:.1f}"), ("agent RSS after imports (MB)", "rss_import_mb", "{:.1f}"),
            ("records sent to Kafka", "sent", "{:,}"), ("ordinary lines counted", "ordinary", "{:,}"),
            ("kernel lines read", "kernel_lines", "{:,}"), ("nccl lines read", "nccl_lines", "{:,}")]
    for label, key, fmt in rows:
        print(f"{label:<40}" + "".join(f"{fmt.format(r[key]):>14}" for r in results))
    head = results[0]
    out = {"bench": "agent_overhead", "cpu_pct_one_core": round(head["cpu_pct"], 2), "rss_peak_mb": round(head["rss_mb"], 1),
           "lines_per_s": args.rate, "gpus": 8, "nvml_hz": 1.0, "records_sent": head["sent"], "mode": head["mode"],
           "send_requests": head.get("requests"), "loop_ticks": head.get("ticks"), "load_avg_1m": os.getloadavg()[0]}
    for r in results[1:]:
        out[f"{r['mode']}_cpu_pct_one_core"] = round(r["cpu_pct"], 2)
        out[f"{r['mode']}_rss_peak_mb"] = round(r["rss_mb"], 1)
        out[f"{r['mode']}_records_sent"] = r["sent"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
