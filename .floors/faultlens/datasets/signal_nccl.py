"""NCCL and torch.distributed output of one rank, as the process prints it.

* NCCL's own lines: ``host:pid:tid [cudaDev] NCCL INFO ...``; since NCCL 2.23
  WARN lines carry a ``[YYYY-MM-DD HH:MM:SS] `` prefix by default
  (NCCL_DEBUG_TIMESTAMP_LEVELS=WARN), INFO lines none.
* PyTorch's C++ logging with the launcher's rank prefix:
  ``[rank3]:[E1121 10:10:00.123456789 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught ...``.
* Python tracebacks, every line prefixed ``[rankN]:``.
* torchrun's own lines (launcher.log): ``E1121 10:05:12.345000 140234 torch/distributed/elastic/...``.

Formats copied from ../shared/reference/real-logs/nccl.jsonl.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from faultlens.datasets.cluster import NCCL_VERSION


@dataclass(frozen=True)
class RankProc:
    """The process of one rank: where it runs and its ids."""

    rank: int
    node: str
    gpu: int
    pid: int
    world: int
    ip: str

    @property
    def tid(self) -> int:
        return self.pid + 97

    def nccl(self, level: str, text: str, ts: float | None = None, *, where: str = "", tid: int | None = None) -> str:
        head = f"{self.node}:{self.pid}:{tid or self.pid} [{self.gpu}]"
        loc = f" {where}" if where else ""
        line = f"{head}{loc} NCCL {level} {text}"
        if level == "WARN" and ts is not None:
            line = f"[{dt.datetime.fromtimestamp(ts, dt.UTC):%Y-%m-%d %H:%M:%S}] {line}"
        return line

    def glog(self, sev: str, ts: float, src: str, text: str) -> str:
        t = dt.datetime.fromtimestamp(ts, dt.UTC)
        nanos = int(round((ts % 1) * 1e9)) % 1_000_000_000
        return f"[rank{self.rank}]:[{sev}{t:%m%d %H:%M:%S}.{nanos:09d} {src}] {text}"

    def py(self, text: str) -> str:
        return f"[rank{self.rank}]:{text}"


def startup_lines(p: RankProc, comm_id: str, nranks: int, ts: float) -> list[tuple[float, str]]:
    """What a rank prints while NCCL initialises the default communicator."""
    nics = " ".join(f"[{i}]mlx5_{i}:1/IB" for i in range(8))
    bus = f"{['18', '2a', '3a', '5d', '9a', 'ab', 'ba', 'db'][p.gpu]}000"
    comm = f"0x{(p.pid * 7919 + 0x55d1c0000000) & 0xffffffffffff:x}"
    lines = [
        p.nccl("INFO", f"Bootstrap : Using ib0:{p.ip}<0>"),
        p.nccl("INFO", "NET/Plugin: No plugin found (libnccl-net.so)"),
        p.nccl("INFO", "cudaDriverVersion 12040"),
        p.nccl("INFO", f"NCCL version {NCCL_VERSION}+cuda12.4"),
        p.nccl("INFO", f"NET/IB : Using {nics} ; OOB ib0:{p.ip}<0>"),
        p.nccl("INFO", "Using network IB"),
        p.nccl("INFO", f"comm {comm} rank {p.rank} nranks {nranks} cudaDev {p.gpu} nvmlDev {p.gpu} busId {bus} commId {comm_id} - Init START"),
        p.nccl("INFO", f"Setting affinity for GPU {p.gpu} to ffffffff,00000000,ffffffff"),
        p.nccl("INFO", f"NVLS multicast support is available on dev {p.gpu}"),
        p.nccl("INFO", "Connected all rings"),
        p.nccl("INFO", "Connected all trees"),
        p.nccl("INFO", "NCCL_PROTO set by environment to simple"),
        p.nccl("INFO", f"comm {comm} rank {p.rank} nranks {nranks} cudaDev {p.gpu} nvmlDev {p.gpu} busId {bus} commId {comm_id} - Init COMPLETE"),
    ]
    return [(ts + 0.002 * i, line) for i, line in enumerate(lines)]


def work_repr(seq: int, op: str, numel: int, timeout_ms: int) -> str:
    return f"WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)={timeout_ms})"


def watchdog_timeout(p: RankProc, ts: float, seq: int, op: str, numel: int, timeout_ms: int, ran_ms: int
                     ) -> list[tuple[float, str]]:
    """The record ProcessGroupNCCL's watchdog prints when a collective times out, then the abort."""
    work = work_repr(seq, op, numel, timeout_ms)
    caught = f"[Rank {p.rank}] Watchdog caught collective operation timeout: {work} ran for {ran_ms} milliseconds before timing out."
    lines = [
        p.glog("E", ts, "ProcessGroupNCCL.cpp:632", caught),
        p.glog("E", ts + 0.0004, "ProcessGroupNCCL.cpp:2168",
               f"[PG 0 Rank {p.rank}] Timeout at NCCL work: {seq}, last enqueued NCCL work: {seq + 2}, last completed NCCL work: {seq - 1}."),
        p.glog("E", ts + 0.0005, "ProcessGroupNCCL.cpp:667",
               f"[Rank {p.rank}] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data."),
        p.glog("E", ts + 0.0006, "ProcessGroupNCCL.cpp:673",
               f"[Rank {p.rank}] To avoid data inconsistency, we are taking the entire process down."),
        p.glog("E", ts + 0.05, "ProcessGroupNCCL.cpp:1664",
               f"[PG 0 Rank {p.rank}] Exception (either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: {seq + 2}, last completed NCCL work: {seq - 1}."),
        p.py("terminate called after throwing an instance of 'c10::DistBackendError'"),
        p.py(f"  what():  [PG 0 Rank {p.rank}] Process group watchdog thread terminated with exception: {caught}"),
    ]
    return [(ts + (0.06 if i >= 5 else 0.0) + 0.0001 * i, line) for i, line in enumerate(lines)]


TRAIN_FRAMES = [
    ('/workspace/Megatron-LM/pretrain_gpt.py', 265, '<module>', 'pretrain('),
    ('/workspace/Megatron-LM/megatron/training/training.py', 360, 'pretrain', 'iteration, num_floating_point_operations_so_far = train('),
    ('/workspace/Megatron-LM/megatron/training/training.py', 1275, 'train', 'train_step(forward_step_func,'),
    ('/workspace/Megatron-LM/megatron/training/training.py', 733, 'train_step', 'losses_reduced = forward_backward_func('),
    ('/workspace/Megatron-LM/megatron/core/pipeline_parallel/schedules.py', 1456, 'forward_backward_pipelining_without_interleaving', 'output_tensor, num_tokens = forward_step('),
    ('/workspace/Megatron-LM/megatron/core/pipeline_parallel/schedules.py', 275, 'forward_step', 'output_tensor, loss_func = forward_step_func(data_iterator, model)'),
]


def traceback(p: RankProc, frames: list[tuple[str, int, str, str]], exc: str, extra: list[str] = ()) -> list[str]:  # type: ignore[assignment]
    lines = [p.py(" Traceback (most recent call last):")]
    for path, line, func, code in frames:
        lines.append(p.py(f'   File "{path}", line {line}, in {func}'))
        lines.append(p.py(f"     {code}"))
    lines.append(p.py(f" {exc}"))
    lines += [p.py(f" {x}") for x in extra]
    return lines


def cuda_error_lines(p: RankProc, message: str) -> list[str]:
    """A CUDA error surfacing in the training loop of this rank."""
    return traceback(p, TRAIN_FRAMES + [
        ('/workspace/Megatron-LM/pretrain_gpt.py', 201, 'forward_step', 'output_tensor = model(tokens, position_ids, attention_mask,'),
        ('/usr/local/lib/python3.10/dist-packages/torch/nn/modules/module.py', 1562, '_call_impl', 'return forward_call(*args, **kwargs)'),
    ], f"RuntimeError: CUDA error: {message}", [
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    ])


def cuda_terminate(p: RankProc, message: str) -> list[str]:
    """The watchdog thread dying on a CUDA error (a GPU that vanished)."""
    lib = "/usr/local/lib/python3.10/dist-packages/torch/lib"
    return [
        p.py("terminate called after throwing an instance of 'c10::Error'"),
        p.py(f"  what():  CUDA error: {message}"),
        p.py("Exception raised from query at ../aten/src/ATen/cuda/CUDAEvent.h:95 (most recent call first):"),
        p.py(f"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f3a1c97c446 in {lib}/libc10.so)"),
        p.py(f"frame #1: c10d::ProcessGroupNCCL::WorkNCCL::finishedGPUExecutionInternal() const + 0x56 (0x7f3a1dc4e8a6 in {lib}/libtorch_cuda.so)"),
        p.py(f"frame #2: c10d::ProcessGroupNCCL::WorkNCCL::isCompleted() + 0xa0 (0x7f3a1dc53b90 in {lib}/libtorch_cuda.so)"),
        p.py(f"frame #3: c10d::ProcessGroupNCCL::watchdogHandler() + 0x1da (0x7f3a1dc5a61a in {lib}/libtorch_cuda.so)"),
        p.py("frame #4: <unknown function> + 0xdc253 (0x7f3a6a8b0253 in /lib/x86_64-linux-gnu/libstdc++.so.6)"),
        p.py("frame #5: <unknown function> + 0x94ac3 (0x7f3a6c42bac3 in /lib/x86_64-linux-gnu/libc.so.6)"),
    ]


def ib_completion_error(p: RankProc, ts: float, peer_ip: str, port: int, status: int, vendor: int,
                        direction: str = "Recv") -> list[tuple[float, str]]:
    opcode = 0 if direction == "Send" else 129
    where = "transport/net_ib.cc:1696"
    return [
        (ts, p.nccl("WARN", f"NET/IB : Got completion from peer {peer_ip}<{port}> with status={status} opcode={opcode} len=0 vendor err {vendor} ({direction}) localGid ::ffff:{p.ip} remoteGids::ffff:{peer_ip}", ts, where=where, tid=p.pid + 211)),
        (ts + 0.0001, p.nccl("INFO", "transport/net.cc:1298 -> 6", tid=p.pid + 211)),
        (ts + 0.0002, p.nccl("INFO", "proxy.cc:698 -> 6", tid=p.pid + 211)),
        (ts + 0.0003, p.nccl("INFO", "proxy.cc:878 -> 6 [Progress Thread]", tid=p.pid + 211)),
    ]


def dist_backend_error(p: RankProc, last_error: str) -> list[str]:
    return traceback(p, TRAIN_FRAMES[:4] + [
        ('/workspace/Megatron-LM/megatron/core/distributed/param_and_grad_buffer.py', 364, 'finish_grad_sync', 'self.grad_reduce_handle.wait()'),
    ], f"torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2006, remote process exited or there was a network error, NCCL version {NCCL_VERSION}",
        ["ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
         "Last error:", last_error])


def launcher_failed(ts: float, agent_pid: int, local_rank: int, pid: int, exitcode: int) -> str:
    t = dt.datetime.fromtimestamp(ts, dt.UTC)
    return (f"E{t:%m%d %H:%M:%S}.{t.microsecond:06d} {agent_pid} torch/distributed/elastic/multiprocessing/api.py:869] "
            f"failed (exitcode: {exitcode}) local_rank: {local_rank} (pid: {pid}) of binary: /usr/bin/python3")


def launcher_start(ts: float, agent_pid: int) -> str:
    t = dt.datetime.fromtimestamp(ts, dt.UTC)
    return (f"W{t:%m%d %H:%M:%S}.{t.microsecond:06d} {agent_pid} torch/distributed/run.py:793] Setting OMP_NUM_THREADS "
            "environment variable for each process to be 1 in default, to avoid your system being overloaded, please "
            "further tune the variable for optimal performance in your application as needed.")
