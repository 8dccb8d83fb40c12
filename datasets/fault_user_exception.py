"""A bug in the training code: the same Python traceback on every rank, no hardware signal.

Footprint: nccl (every rank prints the same ``[rankN]: Traceback ...``
ending in the same exception at the same step; torchrun reports exitcode 1
on every node), steps (stop). Nothing in kernel or gpu beyond the processes
ending. The fix is the code: roll back.

``spread="one"``: what a real DDP job under torchrun showed (benchmarks/realjob.py, torch 2.13,
gloo: tests/fixtures/real_torch/online_exception.jsonl): one rank raises the bug; each other rank
fails 1-6 s later in the collective it was waiting in, with the backend's connection error
(gloo's "Connection closed by peer"): infrastructure words, never the bug's.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault

BUGS = [
    ([("/workspace/Megatron-LM/pretrain_gpt.py", 167, "loss_func", "losses = output_tensor.float()")],
     "AttributeError: 'NoneType' object has no attribute 'float'"),
    ([("/workspace/Megatron-LM/pretrain_gpt.py", 142, "get_batch", "batch = get_batch_on_this_tp_rank(data_iterator)"),
      ("/workspace/Megatron-LM/megatron/training/utils.py", 281, "get_batch_on_this_tp_rank", "'labels': data['label'].cuda(non_blocking = True),")],
     "KeyError: 'label'"),
    ([("/workspace/Megatron-LM/pretrain_gpt.py", 201, "forward_step", "output_tensor = model(tokens, position_ids, attention_mask,"),
      ("/workspace/Megatron-LM/megatron/core/models/gpt/gpt_model.py", 247, "forward", "decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)")],
     "RuntimeError: shape '[4096, 1, 32, 128]' is invalid for input of size 8388608"),
]

# A DDP rank whose peer died while it waited in the gradient all-reduce (torch 2.13, gloo: verbatim but the path)
PEER_FRAMES = [("/usr/local/lib/python3.10/dist-packages/torch/autograd/graph.py", 979, "_engine_run_backward",
                "return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass")]
PEER_LOST = ("RuntimeError: Got the following error when running the callback: RuntimeError: "
             "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:64748. This is typically caused by a remote worker crashing. Check the logs of the remote "
             "worker before reporting an error.")


class UserException(Fault):
    KIND = "user_exception"
    EXPECTED_ACTION = "rollback_code"
    FOOTPRINT = "nccl: identical traceback on every rank; launcher exitcode 1 everywhere; no hardware signal"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        t = ctx.onset(self.onset_s, 0.2, 0.6)
        frames, exc = BUGS[int(self.params.get("bug", ctx.rng.integers(0, len(BUGS))))]
        ctx.stop_training(t)
        one = self.params.get("spread", "all") == "one"
        for r in range(ctx.topology.world_size):
            if one and r != 0:  # the peers: a connection error from the collective, seconds later
                tr = t + float(ctx.rng.uniform(1.0, 6.0))
                ctx.nccl_lines(r, tr, nc.traceback(ctx.procs[r], nc.TRAIN_FRAMES[:5] + PEER_FRAMES, PEER_LOST))
            else:
                tr = t + float(ctx.rng.uniform(0, 0.05))
                ctx.nccl_lines(r, tr, nc.traceback(ctx.procs[r], nc.TRAIN_FRAMES[:5] + frames, exc))
            ctx.exit_ranks([r], tr + 0.2, 1)
        return self.truth(ctx, onset_ts=t, end_ts=None, nodes=[], ranks=[])
