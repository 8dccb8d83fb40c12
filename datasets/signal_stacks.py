"""``py-spy dump --pid`` text of a Megatron-LM training process.

A rank's dump has its MainThread (where the training loop is) and the
pin-memory thread every DataLoader starts. Which frames the MainThread shows
is the rank's *state*: computing, waiting in a collective, or stuck somewhere
(see ../shared/reference/real-logs/stacks.jsonl for real hangs).
"""

from __future__ import annotations

_TORCH = "torch"
_MEG = "megatron"

_OUTER = [
    ("train_step", f"{_MEG}/training/training.py", 733),
    ("train", f"{_MEG}/training/training.py", 1275),
    ("pretrain", f"{_MEG}/training/training.py", 360),
    ("<module>", "pretrain_gpt.py", 265),
]
_SCHEDULE = [("forward_backward_pipelining_without_interleaving", f"{_MEG}/core/pipeline_parallel/schedules.py", 1456)]
_FWD_STEP = [
    ("forward_step", f"{_MEG}/core/pipeline_parallel/schedules.py", 275),
]
_GET_BATCH = [
    ("get_batch", "pretrain_gpt.py", 142),
    ("forward_step", "pretrain_gpt.py", 198),
]

STATES: dict[str, list[tuple[str, str, int]]] = {
    # computing: the MLP of a transformer layer
    "compute": [
        ("linear", f"{_TORCH}/nn/functional.py", 0),
        ("forward", f"{_MEG}/core/tensor_parallel/layers.py", 808),
        ("_call_impl", f"{_TORCH}/nn/modules/module.py", 1562),
        ("forward", f"{_MEG}/core/transformer/mlp.py", 125),
        ("_call_impl", f"{_TORCH}/nn/modules/module.py", 1562),
        ("forward", f"{_MEG}/core/transformer/transformer_layer.py", 312),
        ("_call_impl", f"{_TORCH}/nn/modules/module.py", 1562),
        ("forward", f"{_MEG}/core/transformer/transformer_block.py", 495),
        ("forward", f"{_MEG}/core/models/gpt/gpt_model.py", 235),
        ("forward_step", "pretrain_gpt.py", 201),
    ] + _FWD_STEP + _SCHEDULE + _OUTER,
    # waiting for the gradient all-reduce of the data-parallel group
    "allreduce": [
        ("wait", f"{_TORCH}/distributed/distributed_c10d.py", 0),
        ("finish_grad_sync", f"{_MEG}/core/distributed/param_and_grad_buffer.py", 364),
        ("finish_grad_sync", f"{_MEG}/core/distributed/distributed_data_parallel.py", 311),
    ] + _SCHEDULE + _OUTER,
    # torch's own DistributedDataParallel waiting for its peers' gradients: the all-reduce runs inside
    # autograd, so py-spy shows only the engine's entry, idle (a real gloo job, torch 2.13:
    # tests/fixtures/real_torch/stopped_rank)
    "ddp_backward": [
        ("_engine_run_backward", f"{_TORCH}/autograd/graph.py", 979),
        ("backward", f"{_TORCH}/autograd/__init__.py", 395),
        ("Tensor.backward", f"{_TORCH}/_tensor.py", 623),
        ("<module>", "train.py", 77),
    ],
    # tensor-parallel peers waiting for rank tp=0 to broadcast the batch
    "broadcast": [
        ("broadcast", f"{_TORCH}/distributed/distributed_c10d.py", 2213),
        ("wrapper", f"{_TORCH}/distributed/c10d_logger.py", 83),
        ("_build_key_size_numel_dictionaries", f"{_MEG}/core/tensor_parallel/data.py", 46),
        ("broadcast_data", f"{_MEG}/core/tensor_parallel/data.py", 91),
    ] + _GET_BATCH + _FWD_STEP + _SCHEDULE + _OUTER,
    # other pipeline stages waiting for activations / gradients
    "p2p_recv": [
        ("wait", f"{_TORCH}/distributed/distributed_c10d.py", 0),
        ("_communicate", f"{_MEG}/core/pipeline_parallel/p2p_communication.py", 381),
        ("recv_forward", f"{_MEG}/core/pipeline_parallel/p2p_communication.py", 412),
        ("recv_forward", f"{_MEG}/core/pipeline_parallel/schedules.py", 1198),
    ] + _SCHEDULE + _OUTER,
    # stuck: a DataLoader worker that never delivers (the BLOOM eval deadlock)
    "stuck_dataloader": [
        ("wait", "threading.py", 324),
        ("get", "queue.py", 180),
        ("_try_get_data", f"{_TORCH}/utils/data/dataloader.py", 1133),
        ("_get_data", f"{_TORCH}/utils/data/dataloader.py", 1294),
        ("_next_data", f"{_TORCH}/utils/data/dataloader.py", 1332),
        ("__next__", f"{_TORCH}/utils/data/dataloader.py", 631),
        ("get_batch_on_this_tp_rank", f"{_MEG}/training/utils.py", 262),
    ] + _GET_BATCH + _FWD_STEP + _SCHEDULE + _OUTER,
    # stuck: a CUDA synchronise that never returns (a kernel that hangs on the GPU)
    "stuck_cuda_sync": [
        ("synchronize", f"{_TORCH}/cuda/__init__.py", 954),
        ("_allreduce_layernorm_grads", f"{_MEG}/core/distributed/finalize_model_grads.py", 76),
        ("finalize_model_grads", f"{_MEG}/core/distributed/finalize_model_grads.py", 158),
    ] + _SCHEDULE + _OUTER,
    # stuck in an uninterruptible read (the kernel's hung task)
    "stuck_io": [
        ("_read", f"{_MEG}/core/datasets/indexed_dataset.py", 0),
        ("get", f"{_MEG}/core/datasets/indexed_dataset.py", 536),
        ("_query_document_sample_shuffle_indices", f"{_MEG}/core/datasets/gpt_dataset.py", 228),
        ("__getitem__", f"{_MEG}/core/datasets/gpt_dataset.py", 143),
        ("__getitem__", f"{_MEG}/core/datasets/blended_dataset.py", 106),
        ("fetch", f"{_TORCH}/utils/data/_utils/fetch.py", 52),
        ("_next_data", f"{_TORCH}/utils/data/dataloader.py", 674),
        ("__next__", f"{_TORCH}/utils/data/dataloader.py", 631),
        ("get_batch_on_this_tp_rank", f"{_MEG}/training/utils.py", 262),
    ] + _GET_BATCH + _FWD_STEP + _SCHEDULE + _OUTER,
    # every rank waiting on slow storage (data loader starved)
    "dataloader_wait": [
        ("wait", "threading.py", 324),
        ("get", "queue.py", 180),
        ("_try_get_data", f"{_TORCH}/utils/data/dataloader.py", 1133),
        ("_get_data", f"{_TORCH}/utils/data/dataloader.py", 1294),
        ("_next_data", f"{_TORCH}/utils/data/dataloader.py", 1332),
        ("__next__", f"{_TORCH}/utils/data/dataloader.py", 631),
        ("get_batch_on_this_tp_rank", f"{_MEG}/training/utils.py", 262),
    ] + _GET_BATCH + _FWD_STEP + _SCHEDULE + _OUTER,
}
_LINE_FIX = {"linear": 2025, "wait": 4399, "_read": 241}
IDLE_STATES = frozenset({"stuck_dataloader", "dataloader_wait", "stuck_io", "ddp_backward"})

_PIN_MEMORY = [
    ("do_one_step", f"{_TORCH}/utils/data/_utils/pin_memory.py", 31),
    ("_pin_memory_loop", f"{_TORCH}/utils/data/_utils/pin_memory.py", 54),
    ("run", "threading.py", 953),
    ("_bootstrap_inner", "threading.py", 1016),
    ("_bootstrap", "threading.py", 973),
]

SITE = "/usr/local/lib/python3.10/dist-packages/"
_WORKSPACE = "/workspace/Megatron-LM/"


def _frames(frames: list[tuple[str, str, int]]) -> list[str]:
    out = []
    for func, path, line in frames:
        line = line or _LINE_FIX.get(func, 1)
        full = path if path.startswith(("threading", "queue")) else (SITE + path if path.startswith("torch") else _WORKSPACE + path)
        # py-spy prints paths shortened relative to sys.path, as the real dumps show
        short = full.replace(SITE, "").replace(_WORKSPACE, "")
        out.append(f"    {func} ({short}:{line})")
    return out


def pyspy_dump(pid: int, state: str, cmdline: str) -> str:
    """The text ``py-spy dump --pid PID`` prints for a training rank in ``state``."""
    if state not in STATES:
        raise ValueError(f"unknown stack state {state!r}")
    main = "idle" if state in IDLE_STATES else "active"
    lines = [f"Process {pid}: {cmdline}", "Python v3.10.12 (/usr/bin/python3.10)", "",
             f'Thread {pid} ({main}): "MainThread"']
    lines += _frames(STATES[state])
    lines.append(f'Thread {pid + 311} (idle): "Thread-1 (_pin_memory_loop)"')
    lines.append("    wait (threading.py:324)")
    lines.append("    get (queue.py:180)")
    lines += _frames(_PIN_MEMORY)
    return "\n".join(lines) + "\n"
