"""Hang batch directories written by hand: one (or two) stuck ranks, everyone else waiting on them.

The simulator's hang (datasets/fault_hang_stuck_rank.py) prints one Megatron stack per
state; the cases here vary what a real fleet varies (tests/handwritten.py style, to the
batch contract only): the framework (Megatron-LM, DeepSpeed, plain torch DDP/FSDP,
Lightning), the torch version's paths (relative, site-packages, dist-packages, conda),
py-spy thread headers and names, where the stuck rank waits (CUDA synchronize, an event,
a device-to-host copy seen in native frames, the dataloader queue, a dataset read, a
dataloader worker subprocess stuck in a read, a checkpoint save, an async checkpoint
writer thread, a busy Python loop, one NCCL kernel that never returns on one GPU), a
node that does not answer the dump, missing stack files, and the evidence beside the
stacks (GPU utilisation/power, an Xid line, PyTorch Flight Recorder dumps in pickle and
JSON of several dump versions, with and without stacks).

Waiting ranks follow the job's parallel layout: the stuck rank's tensor-parallel peers
wait in a collective (broadcast when it is the input that is stuck), the other stages of
its pipeline wait in p2p toward it, every other rank in the data-parallel gradient
all-reduce. Used by benchmarks/hangs.py and tests/test_hangroot.py.
"""

from __future__ import annotations

import json
import os
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlens.stream.topology import Topology

T0 = 1_764_100_000.0
STEP_S = 2.0
STEPS = 40
HANG_S = 600.0  # GPU samples go on this long after the last step

# ---------------------------------------------------------------------------- frame text by framework

PREFIXES = ("", "/usr/local/lib/python3.10/dist-packages/", "/opt/conda/lib/python3.11/site-packages/",
            "/usr/lib/python3/dist-packages/")


def _f(func: str, path: str, line: int, prefix: str) -> str:
    if path.startswith(("torch/", "deepspeed/", "lightning/")):
        path = prefix + path
    elif path.startswith("megatron/") and prefix:
        path = "/workspace/Megatron-LM/" + path
    return f"{func} ({path}:{line})"


# the outer frames of the training loop, per framework
OUTER = {
    "megatron": [("train_step", "megatron/training/training.py", 733), ("train", "megatron/training/training.py", 1275),
                 ("pretrain", "megatron/training/training.py", 360), ("<module>", "pretrain_gpt.py", 265)],
    "deepspeed": [("train_batch", "deepspeed/runtime/pipe/engine.py", 388), ("train", "train_ds.py", 97),
                  ("main", "train_ds.py", 150), ("<module>", "train_ds.py", 160)],
    "ddp": [("train_one_epoch", "/workspace/trainer/loop.py", 88), ("fit", "/workspace/trainer/loop.py", 141),
            ("main", "/workspace/train.py", 57), ("<module>", "/workspace/train.py", 71)],
    # torch's own DDP (gloo or NCCL): the gradient all-reduce waits inside autograd (tests/fixtures/real_torch)
    "ddp_autograd": [("train_step", "/workspace/train.py", 77), ("<module>", "/workspace/train.py", 120)],
    "lightning": [("advance", "lightning/pytorch/loops/training_epoch_loop.py", 250),
                  ("run", "lightning/pytorch/loops/fit_loop.py", 205), ("_run_stage", "lightning/pytorch/trainer/trainer.py", 1025),
                  ("fit", "lightning/pytorch/trainer/trainer.py", 538), ("main", "/workspace/nemo_train.py", 44)],
}

COLLECTIVE = {  # (innermost frames) of a rank waiting in a collective, per framework
    "megatron": [("wait", "torch/distributed/distributed_c10d.py", 4399),
                 ("finish_grad_sync", "megatron/core/distributed/param_and_grad_buffer.py", 364),
                 ("finish_grad_sync", "megatron/core/distributed/distributed_data_parallel.py", 311)],
    "deepspeed": [("all_reduce", "torch/distributed/distributed_c10d.py", 2195),
                  ("wrapper", "torch/distributed/c10d_logger.py", 79),
                  ("all_reduce", "deepspeed/comm/torch.py", 158), ("all_reduce", "deepspeed/comm/comm.py", 502),
                  ("allreduce_bucket", "deepspeed/runtime/engine.py", 2341)],
    "ddp": [("all_reduce", "torch/distributed/distributed_c10d.py", 1700),
            ("_sync_grads", "/workspace/trainer/ddp_utils.py", 31), ("step", "/workspace/trainer/loop.py", 64)],
    "ddp_autograd": [("_engine_run_backward", "torch/autograd/graph.py", 979), ("backward", "torch/autograd/__init__.py", 395),
                     ("Tensor.backward", "torch/_tensor.py", 623)],
    "lightning": [("_reduce_scatter_base", "torch/distributed/distributed_c10d.py", 3310),
                  ("_reduce_grad", "torch/distributed/fsdp/_runtime_utils.py", 820),
                  ("_post_backward_hook", "torch/distributed/fsdp/_runtime_utils.py", 741)],
}

TP_WAIT = {  # the stuck rank's tensor-parallel peers
    "broadcast": [("broadcast", "torch/distributed/distributed_c10d.py", 2213),
                  ("wrapper", "torch/distributed/c10d_logger.py", 83),
                  ("_build_key_size_numel_dictionaries", "megatron/core/tensor_parallel/data.py", 46),
                  ("broadcast_data", "megatron/core/tensor_parallel/data.py", 91), ("get_batch", "pretrain_gpt.py", 142)],
    "all_reduce": [("all_reduce", "torch/distributed/distributed_c10d.py", 2050),
                   ("wrapper", "torch/distributed/c10d_logger.py", 75),
                   ("_reduce", "megatron/core/tensor_parallel/mappings.py", 24),
                   ("forward", "megatron/core/tensor_parallel/mappings.py", 211)],
}

P2P_WAIT = {  # (framework, direction the rank waits toward) -> frames
    ("megatron", "prev"): [("wait", "torch/distributed/distributed_c10d.py", 4399),
                           ("_communicate", "megatron/core/pipeline_parallel/p2p_communication.py", 381),
                           ("recv_forward", "megatron/core/pipeline_parallel/p2p_communication.py", 412),
                           ("recv_forward", "megatron/core/pipeline_parallel/schedules.py", 1198),
                           ("forward_backward_pipelining_without_interleaving", "megatron/core/pipeline_parallel/schedules.py", 1456)],
    ("megatron", "next"): [("_wait", "torch/distributed/distributed_c10d.py", 1889),
                           ("_batched_p2p_ops", "megatron/core/pipeline_parallel/p2p_communication.py", 203),
                           ("_communicate", "megatron/core/pipeline_parallel/p2p_communication.py", 376),
                           ("send_forward_recv_backward", "megatron/core/pipeline_parallel/p2p_communication.py", 506),
                           ("send_forward_recv_backward", "megatron/core/pipeline_parallel/schedules.py", 1232),
                           ("forward_backward_pipelining_without_interleaving", "megatron/core/pipeline_parallel/schedules.py", 1476)],
    ("deepspeed", "prev"): [("recv", "torch/distributed/distributed_c10d.py", 1640), ("recv", "deepspeed/runtime/pipe/p2p.py", 84),
                            ("_exec_recv_activations", "deepspeed/runtime/pipe/engine.py", 1004),
                            ("_exec_schedule", "deepspeed/runtime/pipe/engine.py", 1397)],
    ("deepspeed", "next"): [("recv", "torch/distributed/distributed_c10d.py", 1640), ("recv", "deepspeed/runtime/pipe/p2p.py", 84),
                            ("_exec_recv_grads", "deepspeed/runtime/pipe/engine.py", 1097),
                            ("_exec_schedule", "deepspeed/runtime/pipe/engine.py", 1397)],
}

STUCK = {  # where the stuck rank waits; (frames innermost first, GPU util, power share) -- None: keep the job's
    "cuda_sync": ([("synchronize", "torch/cuda/__init__.py", 954),
                   ("_allreduce_layernorm_grads", "megatron/core/distributed/finalize_model_grads.py", 76),
                   ("finalize_model_grads", "megatron/core/distributed/finalize_model_grads.py", 158)], 100, 0.2),
    "event_sync": ([("synchronize", "torch/cuda/streams.py", 224), ("_timer_stop", "/workspace/trainer/timers.py", 40),
                    ("step", "/workspace/trainer/loop.py", 70)], 100, 0.2),
    "item_copy": ([("cudaStreamSynchronize", "libcudart.so.12", 0), ("at::native::_local_scalar_dense_cuda", "libtorch_cuda.so", 0),
                   ("compute_loss", "/workspace/trainer/loss.py", 52), ("step", "/workspace/trainer/loop.py", 66)], 100, 0.2),
    "dataloader": ([("wait", "threading.py", 324), ("get", "queue.py", 180),
                    ("_try_get_data", "torch/utils/data/dataloader.py", 1133), ("_get_data", "torch/utils/data/dataloader.py", 1294),
                    ("_next_data", "torch/utils/data/dataloader.py", 1332), ("__next__", "torch/utils/data/dataloader.py", 631),
                    ("get_batch_on_this_tp_rank", "megatron/training/utils.py", 262)], 0, 0.15),
    "mp_queue": ([("poll", "multiprocessing/connection.py", 257), ("get", "multiprocessing/queues.py", 113),
                  ("_try_get_data", "torch/utils/data/dataloader.py", 1243), ("_next_data", "torch/utils/data/dataloader.py", 1402),
                  ("__next__", "torch/utils/data/dataloader.py", 701)], 0, 0.15),
    "dataset_read": ([("_read", "megatron/core/datasets/indexed_dataset.py", 241),
                      ("get", "megatron/core/datasets/indexed_dataset.py", 536),
                      ("__getitem__", "megatron/core/datasets/gpt_dataset.py", 143),
                      ("fetch", "torch/utils/data/_utils/fetch.py", 52), ("_next_data", "torch/utils/data/dataloader.py", 674),
                      ("__next__", "torch/utils/data/dataloader.py", 631)], 0, 0.15),
    "shard_read": ([("readinto", "/workspace/data/shard_reader.py", 77), ("__getitem__", "/workspace/data/jsonl_dataset.py", 30),
                    ("fetch", "torch/utils/data/_utils/fetch.py", 51), ("_next_data", "torch/utils/data/dataloader.py", 677)], 0, 0.15),
    "ckpt_save": ([("write", "torch/serialization.py", 619), ("_save", "torch/serialization.py", 853),
                   ("save", "torch/serialization.py", 628), ("save_checkpoint", "megatron/training/checkpointing.py", 402)], 0, 0.15),
    "dcp_write": ([("fsync", "os.py", 0), ("_write_files_from_queue", "torch/distributed/checkpoint/filesystem.py", 310),
                   ("write_data", "torch/distributed/checkpoint/filesystem.py", 598),
                   ("save_state_dict", "torch/distributed/checkpoint/state_dict_saver.py", 150)], 0, 0.15),
    "python_loop": ([("_pack_sequences", "/workspace/data/packing.py", 118), ("collate", "/workspace/data/packing.py", 140),
                     ("step", "/workspace/trainer/loop.py", 61)], 0, 0.15),
    # SIGSTOPped (its machine hung): py-spy cannot suspend it (PYSPY_STOPPED) and it writes no Flight Recorder dump
    "stopped": ([], 0, 0.15),
}
# what py-spy 0.4.3 printed for a SIGSTOPped rank (tests/fixtures/real_torch/stopped_rank/pyspy_rank2.*)
PYSPY_STOPPED = ("Process {pid}: /usr/bin/python -u train.py --rank {rank}\nPython v3.10.12 (/usr/bin/python3.10)\n\n"
                 "Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
                 "    1: unexpected waitpid result PtraceEvent(Pid({pid}), SIGSTOP, 128) to {pid}\n")
IDLE_POWER_W, BUSY_POWER_W = 95.0, 640.0


@dataclass
class HangCase:
    """One hang: the layout, the stuck ranks and how, what evidence is written beside the stacks."""

    name: str
    nodes: int
    tp: int
    pp: int
    dp: int
    cp: int = 1
    gpus: int = 8
    order: str = "tp-cp-dp-pp"
    framework: str = "megatron"
    stuck: dict[int, str] = field(default_factory=dict)  # rank -> STUCK key, or "nccl_kernel"
    silent_node: str | None = None  # a node whose ranks did not answer the dump
    child: dict[int, str] = field(default_factory=dict)  # rank -> a subprocess stuck in ("read" | "fsync")
    stacks: bool = True
    drop_stacks: float = 0.0  # share of healthy ranks whose stack file is missing
    gpu_evidence: bool = True
    xid: str | None = None  # a kernel line on the culprit's node
    flight: str | None = None  # None | "pickle" | "json"
    fr_version: str = "2.4"
    variants: tuple[str, ...] = ()  # "native" frames, "old_paths", training in a "train_thread", healthy "noise",
    # the stuck rank's own dump "stuck_missing" (py-spy timed out on it)
    seed: int = 1

    @property
    def topology(self) -> Topology:
        return Topology.packed(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, gpus_per_node=self.gpus, order=self.order,
                               job=f"hang-{self.name}", node_fmt="node-{:02d}")

    def culprits(self) -> set[str]:
        topo = self.topology
        out = {topo.placement[r][0] for r in self.stuck}
        if self.silent_node:
            out.add(self.silent_node)
        return out


def _states(case: HangCase, topo: Topology) -> dict[int, tuple[str, Any]]:
    """rank -> (what, detail): ("stuck", key), ("tp", kind), ("p2p", direction), ("dp", None)."""
    out: dict[int, tuple[str, Any]] = {}
    stuck_ranks = sorted(case.stuck) or ([topo.ranks_on(case.silent_node)[0]] if case.silent_node else [])
    for s in stuck_ranks:
        key = case.stuck.get(s, "silent")
        input_stuck = key in ("dataloader", "mp_queue", "dataset_read", "shard_read")
        for r in topo.group(s, "tp"):
            out.setdefault(r, ("tp", "broadcast" if input_stuck else "all_reduce"))
        if topo.cp > 1:
            for r in topo.group(s, "cp"):
                out.setdefault(r, ("tp", "all_reduce"))
        stage = topo.coords(s)["pp"]
        for peer in topo.group(s, "tp"):
            for r in topo.group(peer, "pp"):
                st = topo.coords(r)["pp"]
                if st != stage:
                    out.setdefault(r, ("p2p", "prev" if st > stage else "next"))
    for s, key in case.stuck.items():
        out[s] = ("stuck", key)
    return out


def _frames(case: HangCase, what: str, detail: Any, prefix: str) -> list[str]:
    fw = case.framework
    outer = OUTER[fw]
    if what == "stuck" and detail != "nccl_kernel":
        inner = STUCK[detail][0]
    elif what == "tp":
        inner = TP_WAIT[detail] if fw in ("megatron", "deepspeed") else COLLECTIVE[fw]
    elif what == "p2p":
        inner = P2P_WAIT[("deepspeed" if fw == "deepspeed" else "megatron", detail)]
    else:
        inner = COLLECTIVE[fw]
    if case.framework == "ddp_autograd" and what != "stuck":
        inner = COLLECTIVE[fw]  # every peer of a DDP job waits in the gradient all-reduce, whatever the stuck rank does
    return [_f(f, p, ln, prefix) if ln else f"{f} ({p})" for f, p, ln in inner + outer]


def pyspy_text(case: HangCase, rank: int, what: str, detail: Any, rng: random.Random) -> str:
    prefix = PREFIXES[case.seed % len(PREFIXES)]  # one install per job
    pid = 30000 + rank * 7
    if what == "stuck" and detail == "stopped":
        return PYSPY_STOPPED.format(pid=pid, rank=rank)
    header = ('Thread {tid} (idle): "MainThread"' if case.framework == "ddp_autograd" else rng.choice(['Thread {tid} (active+gil): "MainThread"', 'Thread {tid} (idle): "MainThread"',
                         "Thread {tid} (active): \"MainThread\""])).format(tid=pid if rng.random() < 0.5 else f"0x7F{pid:08X}")
    lines = [f"Process {pid}: /usr/bin/python -u train.py --rank {rank}", "Python v3.10.12 (/usr/bin/python3.10)", "", header]
    frames = _frames(case, what, detail, prefix)
    if "old_paths" in case.variants:  # Megatron before core/, torch 1.13's line numbers
        frames = [f.replace("megatron/core/pipeline_parallel/", "megatron/").replace("megatron/training/", "megatron/")
                  .replace(":4399)", ":1320)").replace(":2213)", ":1408)") for f in frames]
    if "noise" in case.variants and what == "dp" and rng.random() < 0.05:  # caught in another collective
        frames = [_f("all_gather_into_tensor", "torch/distributed/distributed_c10d.py", 2897, prefix),
                  _f("_gather_params", "megatron/core/distributed/param_and_grad_buffer.py", 120, prefix)] + frames[3:]
    if "native" in case.variants:  # py-spy --native: C frames inside the Python ones
        native = {"stuck": ["ioctl (libc.so.6)", "0x7f3a2c1d4e5f (libcuda.so.1)", "cuStreamSynchronize (libcuda.so.1)",
                            "cudaStreamSynchronize (libcudart.so.12)"] if detail in ("cuda_sync", "event_sync", "item_copy")
                  else ["__futex_abstimed_wait_common (libc.so.6)", "pthread_cond_wait (libc.so.6)"]}
        inner = native.get(what, ["__futex_abstimed_wait_common (libc.so.6)", "pthread_cond_timedwait (libc.so.6)",
                                  "c10d::ProcessGroupNCCL::WorkNCCL::synchronizeInternal (libtorch_cuda.so)",
                                  "c10d::ProcessGroupNCCL::WorkNCCL::wait (libtorch_cuda.so)"])
        frames = inner + frames
    if "train_thread" in case.variants:  # the launcher's MainThread waits; training runs in a thread of its own
        lines[3] = 'Thread 0x7F0000000001 (idle): "MainThread"'
        lines += ["    wait (threading.py:1116)", "    join (threading.py:1096)", "    main (/workspace/launch.py:40)",
                  'Thread 0x7F0000000002 (active): "train-loop"']
    lines += [f"    {f}" for f in frames]
    lines += ['Thread 0x7F5D11FFF640 (idle): "Thread-2 (_pin_memory_loop)"', "    select (selectors.py:416)",
              "    wait (multiprocessing/connection.py:931)", "    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:54)"]
    if rng.random() < 0.5:
        lines += ['Thread 0x7F5CFFFFE640 (idle): "pt_autograd_0"', "    wait (threading.py:324)"]
    if what == "stuck" and detail == "dcp_write":
        lines += ['Thread 0x7F5CFAAAA640 (active): "AsyncCheckpointWriter"', "    fsync (os.py:0)",
                  f"    {_f('_write_files_from_queue', 'torch/distributed/checkpoint/filesystem.py', 310, prefix)}"]
    text = "\n".join(lines) + "\n"
    kind = case.child.get(rank)
    if kind:
        child = (["read (/workspace/data/shard_reader.py:77)", "__getitem__ (/workspace/data/jsonl_dataset.py:30)",
                  "fetch (torch/utils/data/_utils/fetch.py:51)", "_worker_loop (torch/utils/data/_utils/worker.py:308)"]
                 if kind == "read" else ["fsync (os.py:0)", "_save (torch/serialization.py:853)",
                                         "_write (/workspace/ckpt/async_writer.py:21)"])
        text += (f"\nProcess {pid + 1}: /usr/bin/python -u train.py --rank {rank}\nPython v3.10.12 (/usr/bin/python3.10)\n\n"
                 f'Thread {pid + 1} (idle): "MainThread"\n' + "".join(f"    {f}\n" for f in child))
        healthy_worker = ["get (multiprocessing/queues.py:103)", "_worker_loop (torch/utils/data/_utils/worker.py:275)"]
        text += (f"\nProcess {pid + 2}: /usr/bin/python -u train.py --rank {rank}\n\nThread {pid + 2} (idle): \"MainThread\"\n"
                 + "".join(f"    {f}\n" for f in healthy_worker))
    return text


# ---------------------------------------------------------------------------- Flight Recorder dumps
# Shapes from PyTorch's torch/csrc/distributed/c10d/FlightRecorder.hpp (keys, "2.x" versions: pg_config
# ranks as a string, pg_status per pg id, collective_seq_id / p2p_seq_id) and tools/flight_recorder's
# readers (the 1.x "seq_id" key, process_group as (name, desc)).


def flight_dump(case: HangCase, topo: Topology, rank: int, states: dict[int, tuple[str, Any]]) -> dict[str, Any]:
    version = case.fr_version
    major = int(version.split(".")[0])
    what = states.get(rank, ("dp", None))
    pgs = {"tp": topo.group(rank, "tp"), "dp": topo.group(rank, "dp")}
    names = {"tp": str(1 + min(topo.group(rank, "tp"))), "dp": str(10_000 + min(topo.group(rank, "dp")))}
    entries: list[dict[str, Any]] = []
    record = 0
    base = 100
    for kind in ("tp", "dp"):
        if len(pgs[kind]) < 2:
            continue
        done = base + (7 if kind == "tp" else 3)
        # how far this rank got in this group: the stuck rank never enters the next collective (or, when its GPU
        # is stuck in a kernel, enters it but never starts it); the p2p waiters never reach the grad all-reduce
        if what[0] == "stuck" and what[1] != "nccl_kernel":
            last, last_state = done, "completed"
        elif what[0] == "stuck":
            last, last_state = done + 1, "scheduled"
        elif what[0] == "p2p" and kind == "dp":
            last, last_state = done, "completed"
        elif what[0] in ("tp", "p2p") and kind == "tp":
            last, last_state = done + 1, "started"
        else:
            last, last_state = done + 1, "started"
        for seq in range(last - 4, last + 1):
            st = "completed" if seq < last else last_state
            op = "nccl:broadcast" if kind == "tp" and seq % 3 == 0 else ("nccl:all_reduce" if kind == "dp" else "nccl:_allgather_base")
            e: dict[str, Any] = {"record_id": record, "pg_id": int(names[kind]), "process_group": (names[kind], kind),
                                 "op_id": seq, "profiling_name": op, "time_created_ns": int((T0 + seq) * 1e9),
                                 "state": st, "input_sizes": [[4096, 1024]], "output_sizes": [[4096, 1024]],
                                 "input_dtypes": ["BFloat16"], "output_dtypes": ["BFloat16"], "duration_ms": None,
                                 "timeout_ms": 600000, "retired": st == "completed",
                                 "frames": [{"name": "all_reduce", "filename": "torch/distributed/distributed_c10d.py",
                                             "line": 2050}]}
            if major >= 2:
                e.update(collective_seq_id=seq, p2p_seq_id=0, is_p2p=False,
                         time_discovered_started_ns=None if st == "scheduled" else int((T0 + seq) * 1e9) + 1000,
                         time_discovered_completed_ns=int((T0 + seq) * 1e9) + 9000 if st == "completed" else None)
            else:
                e["seq_id"] = seq
                e["process_group"] = [names[kind], kind]
            entries.append(e)
            record += 1
        if kind == "tp" and what[0] == "p2p" and case.pp > 1:
            entries.append({"record_id": record, "pg_id": 99, "process_group": ("99", "pp"), "collective_seq_id": 0,
                            "p2p_seq_id": 41, "op_id": 500, "profiling_name": "nccl:recv 0<-1", "is_p2p": True,
                            "state": "started", "time_created_ns": int(T0 * 1e9), "input_sizes": [], "frames": []})
            record += 1
    if "gloo" in case.variants:
        return _gloo_dump(entries, pgs, names)
    dump: dict[str, Any] = {"version": version, "entries": entries}
    if major >= 2:
        dump["pg_config"] = {names[k]: {"name": names[k], "desc": k, "ranks": str(list(pgs[k]))} for k in pgs}
        dump["pg_status"] = {names[k]: {"last_enqueued_collective": base, "last_started_collective": base,
                                        "last_completed_collective": base} for k in pgs}
        dump["nccl_comm_state"] = {}
    else:
        dump["pg_config"] = {names[k]: {"name": names[k], "desc": k, "ranks": list(pgs[k])} for k in pgs}
    return dump


def _gloo_dump(entries: list[dict[str, Any]], pgs: dict[str, tuple[int, ...]], names: dict[str, str]) -> dict[str, Any]:
    """The same collectives as torch 2.13's gloo writes them (tests/fixtures/real_torch): version "2.10",
    ``gloo:`` names, every entry "scheduled" for ever (completion only in ``retired`` and pg_status, nothing
    ever "started"), the data-parallel group configured under ``''`` while its entries name it, no comm lib."""
    status: dict[str, dict[str, int]] = {}
    for e in entries:
        e["profiling_name"] = str(e["profiling_name"]).replace("nccl:", "gloo:")
        done = e["state"] == "completed"
        e.update(state="scheduled", retired=done, time_discovered_started_ns=None, time_discovered_completed_ns=None)
        st = status.setdefault(str(e["pg_id"]), {"last_enqueued_collective": -1, "last_started_collective": -1,
                                                 "last_completed_collective": -1})
        seq = int(e.get("collective_seq_id", 0))
        st["last_enqueued_collective"] = max(st["last_enqueued_collective"], seq)
        if done:
            st["last_completed_collective"] = max(st["last_completed_collective"], seq)
    config = {("" if k == "dp" else names[k]): {"name": "" if k == "dp" else names[k], "desc": "" if k == "dp" else k,
                                                "ranks": str(list(pgs[k]))} for k in pgs if len(pgs[k]) > 1}
    return {"version": "2.10", "pg_config": config, "pg_status": status, "comm_lib_version": "", "entries": entries}


# ---------------------------------------------------------------------------- the directory


def write_case(case: HangCase, d: Path) -> Path:
    """Write ``case`` as a batch directory (DESIGN.md) at ``d``; truth.json names the culprit machines."""
    rng = random.Random(case.seed)
    topo = case.topology
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.json").write_text(json.dumps(topo.to_job_dict()))
    states = _states(case, topo)
    world = topo.world_size
    last_ts = T0 + STEPS * STEP_S
    (d / "steps").mkdir(exist_ok=True)
    with open(d / "steps" / "steps.jsonl", "w") as fh:
        for s in range(STEPS):
            ts = T0 + (s + 1) * STEP_S
            for r in range(world):
                node = topo.placement[r][0]
                fh.write(json.dumps({"v": 1, "ts": round(ts + rng.uniform(0, 0.02), 3), "job": topo.job, "rank": r,
                                     "node": node, "step": s, "duration_s": STEP_S, "n_seqs": 16, "sum_len": 32768,
                                     "sum_len_sq": 80_000_000, "tokens": 32768}) + "\n")
    odd_gpu: dict[tuple[str, int], tuple[float, float]] = {}
    if case.gpu_evidence:
        for r, key in case.stuck.items():
            n, g = topo.placement[r]
            util, share = (100.0, 0.2) if key == "nccl_kernel" else STUCK[key][1:]
            odd_gpu[(n, g)] = (float(util), BUSY_POWER_W * share)
    for node in topo.nodes:
        nd = d / "nodes" / node
        nd.mkdir(parents=True, exist_ok=True)
        lines = []
        t = T0
        while t < last_ts + HANG_S:
            gpus = []
            for g in range(case.gpus):
                util, power = (97.0, BUSY_POWER_W) if t <= last_ts else (100.0, 0.55 * BUSY_POWER_W)
                if t > last_ts + 10 and (node, g) in odd_gpu:
                    util, power = odd_gpu[(node, g)]
                gpus.append({"index": g, "uuid": f"GPU-{node}-{g}", "pci_bus": f"00000000:{0x18 + g * 0x10:02X}:00.0",
                             "util": util, "mem_used_mb": 70000, "temp_c": 60, "power_w": round(power + rng.uniform(-8, 8), 1),
                             "sm_clock_mhz": 1980, "throttle_reasons": 0, "ecc_sbe": 0, "ecc_dbe": 0, "retired_pages": 0,
                             "remap_pending": 0, "pcie_replay": 0, "nvlink_errors": 0})
            lines.append(json.dumps({"v": 1, "ts": round(t, 3), "node": node, "gpus": gpus}))
            t += 10.0
        (nd / "gpu.jsonl").write_text("\n".join(lines) + "\n")
        kernel = ["[Thu Nov 26 10:00:00 2025] EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode."]
        if case.xid and node in case.culprits():
            stamp = __import__("time").strftime("%a %b %d %H:%M:%S %Y", __import__("time").gmtime(last_ts + 30))
            kernel.append(f"[{stamp}] {case.xid}")
        (nd / "kernel.log").write_text("\n".join(kernel) + "\n")
    dump_ts = last_ts + 120
    if case.stacks:
        (d / "stacks").mkdir(exist_ok=True)
        silent = set(topo.ranks_on(case.silent_node)) if case.silent_node else set()
        for r in range(world):
            if r in silent or (r not in states and rng.random() < case.drop_stacks):
                continue
            if r in case.stuck and "stuck_missing" in case.variants:
                continue
            what, detail = states.get(r, ("dp", None))
            p = d / "stacks" / f"{r}.txt"
            p.write_text(pyspy_text(case, r, what, detail, rng))
            os.utime(p, (dump_ts, dump_ts))
    if case.flight:
        fr = d / "flight_recorder"
        fr.mkdir(exist_ok=True)
        silent = set(topo.ranks_on(case.silent_node)) if case.silent_node else set()
        for r in range(world):
            if r in silent or case.stuck.get(r) == "stopped":
                continue  # a stopped process writes nothing
            dump = flight_dump(case, topo, r, states)
            if case.flight == "json":
                (fr / f"nccl_trace_rank_{r}.json").write_text(json.dumps(dump))
            else:
                (fr / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump, protocol=2 if r % 2 else 4))
    (d / "truth.json").write_text(json.dumps({"culprits": sorted(case.culprits()), "stuck": case.stuck,
                                              "silent_node": case.silent_node}))
    return d


# ---------------------------------------------------------------------------- the cases

XID79 = ("NVRM: Xid (PCI:0000:38:00): 79, pid=12345, name=python, GPU has fallen off the bus.")
XID13 = ("NVRM: Xid (PCI:0000:58:00): 13, pid=4321, name=python, Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): "
         "Out Of Range Address")


def cases() -> list[HangCase]:
    """The hand-written hang cases (layouts 4-64 nodes; every stuck kind; evidence with and without stacks)."""
    c: list[HangCase] = []

    def add(name: str, nodes: int, tp: int, pp: int, dp: int, **kw: Any) -> None:
        c.append(HangCase(name=name, nodes=nodes, tp=tp, pp=pp, dp=dp, seed=len(c) + 1, **kw))

    add("cuda-sync-tp8-dp4", 4, 8, 1, 4, stuck={13: "cuda_sync"})
    add("cuda-sync-tp4-pp2-dp4", 4, 4, 2, 4, stuck={21: "cuda_sync"})
    add("event-sync-ddp-16", 16, 1, 1, 128, framework="ddp", stuck={77: "event_sync"})
    add("item-copy-native-ddp", 8, 1, 1, 64, framework="ddp", stuck={9: "item_copy"})
    add("dataloader-tp8-dp8", 8, 8, 1, 8, stuck={24: "dataloader"})
    add("mp-queue-lightning-fsdp", 8, 1, 1, 64, framework="lightning", stuck={40: "mp_queue"})
    add("dataset-read-tp8-pp4-dp2", 8, 8, 4, 2, stuck={16: "dataset_read"})
    add("shard-read-ddp-4", 4, 1, 1, 32, framework="ddp", stuck={30: "shard_read"})
    add("worker-subprocess-read", 8, 8, 1, 8, stuck={8: "dataloader"}, child={8: "read"})
    add("ckpt-save-tp8-dp8", 8, 8, 1, 8, stuck={0: "ckpt_save"})
    add("dcp-fsync-thread-fsdp", 16, 1, 1, 128, framework="lightning", stuck={101: "dcp_write"})
    add("python-loop-ddp", 4, 1, 1, 32, framework="ddp", stuck={5: "python_loop"})
    add("pipeline4-stage2-cuda", 4, 8, 4, 1, stuck={17: "cuda_sync"})
    add("pipeline8-stage5-read", 8, 8, 8, 1, stuck={40: "dataset_read"})
    add("pipeline8-deepspeed-stage3", 16, 8, 8, 2, framework="deepspeed", stuck={24: "cuda_sync"})
    add("pipeline6-tp4-stage1", 12, 4, 6, 4, stuck={5: "item_copy"})
    add("two-stuck-one-node", 8, 8, 1, 8, stuck={18: "cuda_sync", 21: "cuda_sync"})
    add("two-stuck-one-node-ddp", 4, 1, 1, 32, framework="ddp", stuck={2: "dataloader", 6: "dataset_read"})
    add("silent-node-tp8-dp8", 8, 8, 1, 8, silent_node="node-03")
    add("silent-node-tp4-pp4", 16, 4, 4, 8, silent_node="node-11")
    add("cp2-tp4-cuda", 8, 4, 2, 4, cp=2, stuck={33: "cuda_sync"})
    add("cp2-tp8-dataloader", 16, 8, 1, 8, cp=2, stuck={64: "dataloader"})
    add("order-tp-pp-dp", 8, 8, 2, 4, order="tp-cp-pp-dp", stuck={40: "cuda_sync"})
    add("big-64-tp8-pp4-dp16", 64, 8, 4, 16, stuck={300: "cuda_sync"})
    add("big-64-ddp-ckpt", 64, 8, 1, 64, stuck={8 * 37: "ckpt_save"}, drop_stacks=0.02)
    add("missing-stacks-tp8", 16, 8, 2, 8, stuck={70: "dataset_read"}, drop_stacks=0.05)
    add("nccl-kernel-gpu-only", 8, 8, 1, 8, stuck={45: "nccl_kernel"})
    add("nccl-kernel-xid13", 8, 8, 1, 8, stuck={12: "nccl_kernel"}, xid=XID13)
    add("nccl-kernel-fr-pickle", 8, 8, 1, 8, stuck={50: "nccl_kernel"}, flight="pickle", gpu_evidence=False)
    add("nccl-kernel-fr-json-v1", 4, 8, 1, 4, stuck={3: "nccl_kernel"}, flight="json", fr_version="1.5", gpu_evidence=False)
    add("fr-only-pickle-dataloader", 8, 8, 1, 8, stuck={24: "dataloader"}, flight="pickle", stacks=False, gpu_evidence=False)
    add("fr-only-json-v2.2-cuda", 16, 8, 1, 16, stuck={77: "cuda_sync"}, flight="json", fr_version="2.2", stacks=False,
        gpu_evidence=False)
    add("fr-only-pipeline", 8, 8, 4, 2, stuck={17: "cuda_sync"}, flight="json", fr_version="2.7", stacks=False,
        gpu_evidence=False)
    add("fr-and-stacks-pipeline", 8, 8, 4, 2, stuck={17: "cuda_sync"}, flight="pickle", fr_version="2.4")
    add("fr-and-stacks-silent-node", 8, 8, 1, 8, silent_node="node-06", flight="pickle")
    # torch 2.13 over gloo, as a real run printed it (tests/fixtures/real_torch): DDP waits inside autograd,
    # a SIGSTOPped rank that py-spy cannot suspend and that writes no dump; a rank behind, dumps only
    add("gloo-ddp-stopped-rank", 4, 1, 1, 32, framework="ddp_autograd", stuck={13: "stopped"}, flight="pickle",
        variants=("gloo",), gpu_evidence=False)
    add("gloo-ddp-fr-only-behind", 4, 1, 1, 32, framework="ddp_autograd", stuck={22: "python_loop"}, flight="json",
        stacks=False, variants=("gloo",), gpu_evidence=False)
    add("xid79-and-stacks", 4, 8, 1, 4, stuck={19: "cuda_sync"}, xid=XID79)
    # the same faults as a different fleet prints them
    add("native-frames-cuda", 8, 8, 1, 8, stuck={29: "cuda_sync"}, variants=("native",))
    add("native-frames-dataloader-pp", 8, 8, 2, 4, stuck={40: "dataloader"}, variants=("native",))
    add("old-megatron-paths-pp4", 8, 8, 4, 2, stuck={48: "cuda_sync"}, variants=("old_paths",))
    add("train-thread-ddp", 8, 1, 1, 64, framework="ddp", stuck={33: "shard_read"}, variants=("train_thread",))
    add("healthy-noise-tp8-dp16", 16, 8, 1, 16, stuck={90: "ckpt_save"}, variants=("noise",))
    add("stuck-rank-dump-missing", 8, 8, 1, 8, stuck={37: "cuda_sync"}, variants=("stuck_missing",), gpu_evidence=False)
    add("stuck-rank-dump-missing-pp", 8, 4, 4, 4, stuck={9: "dataset_read"}, variants=("stuck_missing",))
    add("three-stuck-three-nodes", 16, 8, 1, 16, stuck={10: "cuda_sync", 50: "cuda_sync", 90: "cuda_sync"})
    add("native-old-train-thread-ds", 16, 8, 8, 2, framework="deepspeed", stuck={56: "item_copy"},
        variants=("native", "old_paths", "train_thread"))
    return c
