"""On a host with an NVIDIA GPU: the NVML collector and the Xid path against a real driver.

Not a performance figure: a record of what the collector reads from a real driver, run
wherever a GPU is at hand (the project's CI has none). It checks, in order:

1. ``PynvmlBackend`` opens NVML and reads ``--samples`` samples one second apart; each
   sample goes through the agent's wire encoder and back through the one decoder
   (faultlens/decode.py), and every field the decoder had to null is listed (a real
   driver's types must decode clean).
2. NVML's event set: whether Xid / ECC events register on this GPU, and what a short
   wait returns.
3. The kernel-log path: the agent's ``KmsgReader`` follows /dev/kmsg from its end; the
   script writes one Xid line into /dev/kmsg (root only: the way gpud's injector
   tests its own path) and reads it back through ``KernelParser`` and the signature
   classifier, timing line -> verdict.
4. ``nvidia-smi -q`` text of this machine through the nvidia-smi classifier (a healthy
   GPU must read as normal).
5. ``--agent``: the real agent as a process (``faultlens agent --kernel-log kmsg``, NVML
   on) against the embedded broker, with the online diagnosis service running; an Xid 79
   naming this machine's first GPU written into /dev/kmsg; the gpu, kernel and actions
   topics read back: samples received, the Xid record (PCI bus -> GPU index), line ->
   topic and line -> action latency.

Prints a report and, last, one JSON object (``{"bench": "device_check", ...}``).
``--out DIR`` also writes the raw samples and the nvidia-smi text there.

Example:
    python benchmarks/device_check.py --samples 5 --out /tmp/device --agent 60
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from faultlens import decode as decoder
from faultlens import lifeline, schema
from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.kernel_follow import KmsgReader
from faultlens.collectors.nvml import PynvmlBackend
from faultlens.collectors.signatures import classify, classify_nvsmi
from faultlens.errors import FaultlensError


def _sample_nvml(n: int, report: dict[str, Any], out: Path | None) -> None:
    backend = PynvmlBackend()
    try:
        backend.open()
    except FaultlensError as exc:
        report["nvml"] = f"no data: {exc}"
        print(f"NVML: {exc}")
        return
    report["gpus"] = backend.device_count()
    nulled: dict[str, int] = {}
    samples = []
    for _ in range(n):
        gpus = backend.read()
        sample = schema.GpuSample(node=os.uname().nodename, ts=time.time(), gpus=gpus)
        for wire in (decoder.encode_wire(sample), schema.encode(sample)):  # MessagePack and JSON
            issues: list[decoder.FieldIssue] = []
            decoded = decoder.decode("gpu", wire, content_type=decoder.content_type_of(wire), issues=issues)
            if len(decoded.gpus) != len(gpus):
                nulled["gpus lost in the round trip"] = nulled.get("gpus lost in the round trip", 0) + 1
            for q in issues:
                key = f"{q.field}: {q.reason} ({q.value})"
                nulled[key] = nulled.get(key, 0) + 1
        samples.append(schema.to_dict(sample))
        time.sleep(1.0)
    raw_remap = None
    try:  # the driver's own types for the row-remap flags (NVML returns integers, not booleans)
        import pynvml

        raw_remap = [type(v).__name__ + ":" + str(v)
                     for v in pynvml.nvmlDeviceGetRemappedRows(pynvml.nvmlDeviceGetHandleByIndex(0))]
    except Exception as exc:  # noqa: BLE001 - a check script reports what the driver said
        raw_remap = f"{type(exc).__name__}: {exc}"
    report["raw_remapped_rows"] = raw_remap
    report["unsupported_calls"] = sorted(backend._unsupported[0]) if backend._unsupported else []  # noqa: SLF001
    events = backend.wait_events(2.0)
    report["event_set"] = backend._event_set is not None  # noqa: SLF001 - a check script reads it
    report["events_in_2s"] = [str(e) for e in events]
    backend.close()
    report["samples"] = len(samples)
    report["nulled_fields"] = nulled
    report["first_gpu"] = samples[0]["gpus"][0] if samples and samples[0]["gpus"] else {}
    print(f"NVML: {report['gpus']} GPU(s), {len(samples)} samples, fields nulled by the decoder: {nulled or 'none'}")
    print(f"  first GPU: {report['first_gpu']}")
    print(f"  event set: {report['event_set']}, events in 2 s: {report['events_in_2s']}")
    print(f"  calls the driver does not support here: {report['unsupported_calls']}")
    print(f"  nvmlDeviceGetRemappedRows as the driver returns it: {raw_remap}")
    if out is not None:
        (out / "nvml_samples.json").write_text(json.dumps(samples, indent=1, default=str))


def _xid_through_kmsg(report: dict[str, Any]) -> None:
    try:
        reader = KmsgReader("/dev/kmsg", from_end=True)
    except FaultlensError as exc:
        report["kmsg"] = f"no data: {exc}"
        print(f"kmsg: {exc}")
        return
    line = "NVRM: Xid (PCI:0000:00:00): 79, pid=0, GPU has fallen off the bus. (faultlens device_check, injected)"
    try:
        with open("/dev/kmsg", "w") as kmsg:
            kmsg.write(f"<3>{line}\n")
    except OSError as exc:
        report["kmsg"] = f"cannot inject into /dev/kmsg: {exc.strerror}"
        print(report["kmsg"])
        return
    t0 = time.perf_counter()
    parser = KernelParser(node=os.uname().nodename)
    verdict = None
    raw: list[str] = []
    while time.perf_counter() - t0 < 5.0 and verdict is None:
        lines = reader.poll()
        raw.extend(lines)
        for rec in parser.parse(lines):
            if rec.xid == 79:
                verdict = classify(rec)
        time.sleep(0.01)
    reader.close()
    ms = (time.perf_counter() - t0) * 1000
    report["kmsg_lines_read"] = raw[-3:]
    if verdict is None:
        report["kmsg"] = "injected Xid not read back within 5 s"
    else:
        report["kmsg"] = "ok"
        report["xid_verdict"] = {"category": verdict.category, "severity": verdict.severity,
                                 "action": verdict.action, "rule": verdict.rule, "ms": round(ms, 1)}
    print(f"kmsg: {report['kmsg']}; lines read: {raw[-3:]}; verdict: {report.get('xid_verdict')}")


def _nvidia_smi(report: dict[str, Any], out: Path | None) -> None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        report["nvidia_smi"] = "not on PATH"
        return
    text = subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=60).stdout
    c = classify_nvsmi(text)
    report["nvidia_smi"] = {"category": c.category, "severity": c.severity, "action": c.action}
    print(f"nvidia-smi -q ({len(text.splitlines())} lines): {report['nvidia_smi']}")
    if out is not None:
        (out / "nvidia-smi-q.txt").write_text(text)


def _xid_line(bus_id: str, tag: str) -> str:
    """An Xid 79 line as the driver prints it, for this machine's GPU (NVML ``00000000:1B:00.0`` -> ``0000:1b:00``)."""
    dom, bus, dev = (bus_id.split(":") + ["0", "0", "0"])[:3] if bus_id else ("0", "00", "06.0")
    return f"NVRM: Xid (PCI:{int(dom, 16) & 0xFFFF:04x}:{bus.lower()}:{dev.split('.')[0].lower()}): 79, pid=0, " \
           f"GPU has fallen off the bus. ({tag}, injected)"


def _agent_end_to_end(report: dict[str, Any], seconds: float, kernel_log: str = "kmsg") -> None:
    """The real agent (NVML on, /dev/kmsg) -> embedded broker -> online diagnosis -> the action."""
    from faultlens.config import BusConfig, Config, DiagnosisConfig, GuardConfig
    from faultlens.diagnosis.online import DiagnosisService
    from faultlens.stream.bus import Consumer, Producer, ensure_topics
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker
    from faultlens.stream.topology import Topology

    node = "gpu-node-1"
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, linger_ms=0)
        ensure_topics(bus)
        config = Config(bus=bus, diagnosis=DiagnosisConfig(group_id="device-check", max_evidence_age_s=0),
                        guard=GuardConfig(max_evicted_fraction=1.0))
        service = DiagnosisService(config, bootstrap=broker.bootstrap, poll_timeout_ms=20, from_beginning=True).start()
        topo = Topology.packed(tp=8, pp=1, dp=2, gpus_per_node=8, job="device-check", node_fmt="gpu-node-{:d}")
        with Producer(bus, broker.bootstrap) as producer:
            producer.send(schema.JobTopology(ts=time.time(), **topo.to_job_dict()))
            producer.flush(5)
        spool = Path("/tmp/faultlens-device-spool")
        agent = lifeline.spawn(  # dies with this script
            [sys.executable, "-m", "faultlens.cli", "agent", "--bootstrap-servers", broker.bootstrap,
             "--kernel-log", kernel_log, "--node", node, "--job", "device-check", "--spool-dir", str(spool),
             "--metrics-port", "0", "--duration-s", str(seconds + 10)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        consumer = Consumer(bus, ["gpu", "kernel", "actions"], group_id=None, bootstrap=broker.bootstrap,
                            fetch_max_wait_ms=10)
        gpu_samples, xid_at, action_at, injected_at, action = 0, None, None, None, None
        started, deadline = time.time(), time.time() + seconds
        up = (lambda: gpu_samples >= 3) if report.get("gpus") else (lambda: time.time() - started > 5)  # noqa: E731
        line = _xid_line(str(report.get("first_gpu", {}).get("pci_bus", "")), "faultlens device_check --agent")
        while time.time() < deadline and action_at is None:
            if injected_at is None and up() and service.engine.job_of_node(node) == "device-check":
                injected_at = time.time()  # the agent is up (samples flow) and diagnosis knows the job
                with open("/dev/kmsg", "w") if kernel_log == "kmsg" else open(kernel_log, "a") as kmsg:  # no seek on kmsg
                    kmsg.write(f"<3>{line}\n" if kernel_log == "kmsg" else f"{line}\n")
            for m in consumer.poll(timeout_ms=5):
                if m.kind == "gpu":
                    gpu_samples += 1
                elif m.kind == "kernel" and b"device_check --agent" in m.value and xid_at is None:
                    xid_at = time.time()
                    rec = decoder.decode("kernel", m.value, content_type=m.content_type)
                    report["agent_xid_record"] = {"xid": rec.xid, "pci_bus": rec.pci_bus, "gpu": rec.gpu,
                                                  "kind": rec.kind}
                elif m.kind == "actions" and injected_at is not None:
                    a = schema.decode("actions", m.value)
                    if node in a.nodes:
                        action_at, action = time.time(), a
        consumer.close()
        service.stop()
        agent.terminate()
        try:
            out, _ = agent.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
            out, _ = agent.communicate()
    since = lambda t: None if t is None or injected_at is None else round(t - injected_at, 3)  # noqa: E731
    report["agent_xid_line"] = line
    report["agent_gpu_samples"] = gpu_samples
    report["agent_xid_on_topic_s"] = since(xid_at)
    report["agent_xid_to_action_s"] = since(action_at)
    report["agent_action"] = None if action is None else {"type": str(action.type), "nodes": list(action.nodes),
                                                          "confidence": action.confidence}
    report["agent_log_tail"] = out.splitlines()[-8:]
    print(f"agent: {gpu_samples} GPU samples on the gpu topic; injected {line!r}")
    print(f"  on the kernel topic after {report['agent_xid_on_topic_s']} s: {report.get('agent_xid_record')}")
    print(f"  action after {report['agent_xid_to_action_s']} s: {report['agent_action']}")
    print("  agent log tail:\n    " + "\n    ".join(report["agent_log_tail"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=5, help="NVML samples, one a second (default 5)")
    ap.add_argument("--out", type=Path, default=None, help="write raw samples and nvidia-smi text here")
    ap.add_argument("--quick", action="store_true", help="two samples")
    ap.add_argument("--smoke", action="store_true",
                    help="one sample, nothing written to /dev/kmsg (seconds; also on a host without a GPU)")
    ap.add_argument("--agent", type=float, default=0.0, metavar="SECONDS",
                    help="also run the real agent against the embedded broker for this long (root, /dev/kmsg)")
    ap.add_argument("--kernel-log", default="kmsg", metavar="kmsg|PATH",
                    help="where --agent's agent reads and the script writes its Xid line (default /dev/kmsg; a file "
                         "tries the path on a host whose kernel log is not yours to write)")
    args = ap.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"bench": "device_check"}
    _sample_nvml(1 if args.smoke else 2 if args.quick else args.samples, report, args.out)
    if args.smoke:  # a test runs this: the host's kernel log is not the test's to write
        report["kmsg"] = "skipped (--smoke writes nothing to /dev/kmsg)"
    else:
        _xid_through_kmsg(report)
    _nvidia_smi(report, args.out)
    if args.agent > 0:
        _agent_end_to_end(report, args.agent, args.kernel_log)
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
