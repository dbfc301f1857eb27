"""Training on several processes (torchrun): this process's place among them (``Dist``) and how
the model is spread over them (``Parallel``, ``train.distributed``).

* ``ddp`` (the default): every process holds the whole model and its optimizer state;
  DistributedDataParallel averages the gradients after backward.
* ``fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): every block of the model is
  one unit, the rest (embeddings, the output layer, final norms) the root unit, as torchtitan and
  litgpt wrap. Each process holds 1/world of every parameter, gradient and Adam moment; a unit's
  parameters are gathered for its forward and backward and its gradients reduce-scattered.
  On CUDA with ``train.bf16`` the gathered parameters are bf16 and the reduction fp32; on the CPU
  all is fp32.

Under both, gradient accumulation defers the reduction to the last micro-batch of an update;
clipping uses the global norm (the norm of the whole gradient, across shards); checkpoints hold
the whole model as one process would write it (gathered to rank 0 under fsdp), so a checkpoint
written by any number of processes loads into one, and one written by one resumes under either.

Multi-node runs are torchrun's: ``--nnodes``, ``--node-rank`` and a c10d rendezvous (README,
"Several machines").
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import AtencionError

STRATEGIES = ("ddp", "fsdp")
log = logging.getLogger(__name__)


@dataclass
class Dist:
    """This process's place among the torchrun processes (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def init_distributed(device: torch.device) -> Dist:
    """Join torchrun's process group (nccl on CUDA, gloo on the CPU); one process without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size())


def set_activation_checkpointing(model: nn.Module, on: bool) -> int:
    """train.activation_checkpointing: each block keeps only its input for backward and computes
    its activations again there (nn/layers.Block). Returns the number of blocks."""
    from ..nn.layers import Block

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.checkpointing = on
    return len(blocks)


class Parallel:
    """The model as the processes share it: ``forward`` (what the task's loss calls), the
    accumulation's deferred reduction, the global gradient norm, and the whole state gathered for
    a checkpoint."""

    def __init__(self, model: nn.Module, strategy: str, dist_: Dist, device: torch.device, bf16: bool,
                 find_unused: bool):
        if strategy not in STRATEGIES:
            raise AtencionError(f"train.distributed must be one of {list(STRATEGIES)}, got {strategy!r}")
        self.model, self.dist = model, dist_
        self.sharded = strategy == "fsdp" and dist_.world > 1
        if self.sharded:
            self.forward = _fully_shard(model, device, bf16)
            held = sum(p.to_local().numel() for p in model.parameters())
            log.info("fsdp: this process holds %d of the %d parameters (%d processes)", held,
                     sum(p.numel() for p in model.parameters()), dist_.world)
        elif dist_.world > 1:
            self.forward = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
        else:
            self.forward = model

    def accumulating(self, last: bool):
        """The context of one micro-batch's forward and backward: the reduction over processes
        waits for the ``last`` micro-batch of the update."""
        if self.dist.world == 1:
            return nullcontext()
        if self.sharded:
            self.model.set_requires_gradient_sync(last)
            return nullcontext()
        return nullcontext() if last else self.forward.no_sync()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradient to ``max_norm`` (math.inf: measure only); the norm of the whole
        gradient, over every shard."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The model's whole state dict (CPU tensors) on rank 0, None on the others; every process
        must call it under fsdp (the shards are gathered)."""
        if not self.sharded:
            return self.model.state_dict() if self.dist.main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.dist.main else None

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The optimizer's state dict as one process would hold it (parameters by their index in
        the groups) on rank 0, None on the others; every process must call it under fsdp."""
        if not self.sharded:
            return optimizer.state_dict() if self.dist.main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self.model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.dist.main:
            return None
        names = [name for group in full["param_groups"] for name in group["params"]]
        index = {name: i for i, name in enumerate(names)}
        return {"state": {index[name]: values for name, values in full["state"].items()}}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Give the optimizer ``state`` ({"state": {index: {name: tensor}}}, a whole, one-process
        state): as it is, or under fsdp each process its shard of it."""
        if not self.sharded:
            current = optimizer.state_dict()
            current["state"] = state["state"]
            optimizer.load_state_dict(current)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        names = [name for group in get_optimizer_state_dict(self.model, optimizer)["param_groups"]
                 for name in group["params"]]
        full = get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(full_state_dict=True))
        full["state"] = {names[i]: values for i, values in state["state"].items()}
        set_optimizer_state_dict(self.model, optimizer, full, options=StateDictOptions(full_state_dict=True))


def _fully_shard(model: nn.Module, device: torch.device, bf16: bool) -> nn.Module:
    """FSDP2 over ``model``, in place: one unit per block, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..nn.layers import Block

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 and device.type == "cuda" else MixedPrecisionPolicy()
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
