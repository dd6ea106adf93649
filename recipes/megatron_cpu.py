"""megatron-core helpers for tiny GPT models, with the CPU workarounds in one place.

megatron-core 0.16.1 assumes CUDA in a few places that a forward/backward of a small GPTModel
goes through. On a CPU-only torch (``torch.cuda.is_available()`` is False) this module avoids
them without patching torch or megatron-core (one import-time shortcut aside, in
``recipes/megatron_import.py``: megatron-core imported without torch's compiler stack):

* RNG tracker: ``model_parallel_cuda_manual_seed(..., inference_rng_tracker=True)``, whose
  ``fork()`` is a no-op (the training tracker calls ``torch.cuda.get_rng_state``). The tiny
  model has no dropout, so nothing depends on the tracker's streams.
* Attention scratch: the ``("mpu", dtype)`` entry of ``parallel_state``'s global memory buffer
  is allocated on CPU before attention asks for it (it would allocate on
  ``torch.cuda.current_device()``).
* Causal mask: passed explicitly (``attention_mask=None`` builds one on ``device="cuda"``).
* Positions: ``learned_absolute`` (rotary embeddings call ``torch.cuda.current_device()``).

On CUDA the ordinary path is used: nccl, the training RNG tracker, rotary positions, no
explicit mask. megatron-core's DDP and optimizers need CUDA, so the helpers here use plain
``torch.optim.Adam`` with a sharded state dict built by ``dist_checkpointing.optimizer``.
"""

from __future__ import annotations

import copy
import datetime
import math
import socket
from dataclasses import dataclass
from itertools import chain

import torch

from recipes.megatron_import import import_megatron_core

# Before the first megatron import of the process: on CPU, without torch's compiler stack.
import_megatron_core()

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

__all__ = [
    "TinyGPTConfig",
    "build_tiny_gpt",
    "causal_batch",
    "causal_inputs",
    "compute_loss",
    "destroy_distributed",
    "gather_vocab_logits",
    "host_rendezvous",
    "init_distributed",
    "join_rendezvous",
    "load_optimizer_state",
    "make_adam",
    "optimizer_sharded_state_dict",
    "reserve_cpu_attention_buffer",
    "train_step",
]

Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor]

_ON_CPU_DEFAULT_SCRATCH_NUMEL = 1 << 20  # 4 MiB of float32; grown on demand by compute_loss


def _cuda() -> bool:
    return torch.cuda.is_available()


def host_rendezvous(world_size: int, timeout_s: float = 120.0) -> torch.distributed.TCPStore:
    """Rank 0's side of a role's rendezvous: a TCPStore server on a loopback port the OS picks.

    The port is bound here and stays bound while the store lives: report ``store.port`` to the
    other ranks, which ``join_rendezvous`` it. (Finding a free port, closing it and letting
    ``init_process_group`` bind it again later was a race: any process could take the port in
    between.) The socket is bound to 127.0.0.1 and handed over to the store, because a TCPStore
    that binds the port itself listens on every interface. Nobody waits for the other ranks
    here: ``init_distributed`` does, within its timeout.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        store = torch.distributed.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    # The store's server owns the socket now (and closes it); Python must not close it too.
    listener.detach()
    return store


def join_rendezvous(
    port: int, world_size: int, timeout_s: float = 120.0
) -> torch.distributed.TCPStore:
    """The other ranks' side: a client of rank 0's store on 127.0.0.1:``port`` (connecting is
    retried until ``timeout_s``)."""
    return torch.distributed.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def init_distributed(
    rank: int,
    world_size: int,
    master_port: int | None = None,
    tensor_parallel_size: int = 1,
    timeout_s: float = 120.0,
    seed: int = 1234,
    store: torch.distributed.Store | None = None,
) -> None:
    """Join the default process group on loopback and set up megatron's parallel state.

    gloo on CPU, nccl on CUDA. The rendezvous is ``store`` when given (``host_rendezvous`` on
    rank 0, ``join_rendezvous`` on the others: no port is ever free between being chosen and
    being used), else ``tcp://127.0.0.1:{master_port}`` (rank 0 binds ``master_port`` only
    here; the caller must make sure nothing else took it). megatron's model-parallel groups
    are built on the same store. One torch thread per rank: with more threads than cores,
    step times vary by an order of magnitude and results change in the last bits.
    """
    if (store is None) == (master_port is None):
        raise ValueError("init_distributed: give exactly one of master_port and store")
    torch.set_num_threads(1)
    if _cuda():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    rendezvous = (
        {"store": store} if store is not None else {"init_method": f"tcp://127.0.0.1:{master_port}"}
    )
    torch.distributed.init_process_group(
        backend="nccl" if _cuda() else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **rendezvous,
    )
    # No second set of data-parallel groups on gloo when every group is gloo already: they
    # serve the distributed optimizer's host-side collectives beside NCCL, and on CPU each
    # would be one more idle gloo device, whose event-loop thread wakes every few ms (a
    # rank holds about 20 groups: 4 to 5% of a core per idle rank).
    parallel_state.initialize_model_parallel(
        tensor_parallel_size,
        1,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
        create_gloo_process_groups=_cuda(),
    )
    # force_reset_rng: a process may init/destroy several times (tests).
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not _cuda(), force_reset_rng=True
    )
    if not _cuda():
        reserve_cpu_attention_buffer(_ON_CPU_DEFAULT_SCRATCH_NUMEL, torch.float32)


def destroy_distributed() -> None:
    """Tear down megatron's parallel state (and its memory buffer), then the process group."""
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def reserve_cpu_attention_buffer(numel: int, dtype: torch.dtype = torch.float32) -> None:
    """Make sure megatron's attention scratch buffer exists on CPU with at least ``numel``.

    ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()`` whenever its
    buffer is missing or too small; pre-sizing it on CPU keeps it from ever doing so.
    No-op on CUDA.
    """
    if _cuda():
        return
    buffers = parallel_state.get_global_memory_buffer().buffer
    current = buffers.get(("mpu", dtype))
    if current is None or current.numel() < numel:
        buffers[("mpu", dtype)] = torch.empty(numel, dtype=dtype, device="cpu")


@dataclass(frozen=True)
class TinyGPTConfig:
    """Shape of the tiny GPT used by tests and recipes (divisible by TP=2)."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_attention_heads: int = 4
    seq_length: int = 16
    ffn_hidden_size: int = 64
    # None: learned_absolute on CPU (rotary needs CUDA), rope on CUDA.
    position_embedding_type: str | None = None
    # The output layer reuses the word embeddings (GPT-2's layout); megatron-core's default
    # is an output layer of its own.
    share_embeddings_and_output_weights: bool = False


def build_tiny_gpt(cfg: TinyGPTConfig, seed: int) -> GPTModel:
    """Build a GPTModel with the local (non-TE) layer spec, deterministic given ``seed``.

    Weights are initialised on CPU as full master weights and split across TP ranks
    (``use_cpu_initialization``), so every TP rank draws the same numbers. The global torch RNG
    is left as it was. No dropout, so training does not depend on RNG streams.
    Needs ``init_distributed`` first. Moved to the current CUDA device when CUDA is available.
    """
    config = TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    pos = cfg.position_embedding_type or ("rope" if _cuda() else "learned_absolute")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            position_embedding_type=pos,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        )
    if _cuda():
        model.cuda(torch.cuda.current_device())
    return model


def make_adam(model: torch.nn.Module, lr: float = 1e-3) -> torch.optim.Adam:
    """Plain torch Adam: megatron-core's optimizers call CUDA (clip_grads, buffers)."""
    return torch.optim.Adam(model.parameters(), lr=lr)


def _materialise_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create, for parameters without state, exactly the state Adam's lazy init would create.

    Before the first step Adam's state is empty and a sharded template would have nothing to
    save or load into. The zeros and step 0 created here are what ``Adam._init_group`` creates
    on the first step (it skips initialisation when the state is non-empty), so the next step
    is bitwise the same as without this call.
    """
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group.get("capturable", False) or group.get("fused", False)
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) > 0:
                continue
            dev = p.device if on_device else "cpu"
            state["step"] = torch.zeros(
                (), dtype=torch.float32 if on_device else scalar_dtype, device=dev
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_sharded_state_dict(
    model: GPTModel, optimizer: torch.optim.Optimizer, model_sharded: dict | None = None
) -> dict:
    """Sharded state dict of a torch Adam over ``model``, laid out like megatron's optimizers.

    Each moment becomes a ShardedTensor keyed ``optimizer.state.<name>.<param key>`` with the
    parameter's sharding and replica id; ``step`` (a scalar, the same for every parameter) is
    stored once as ``state["common_step"]``; ``param_groups`` keep their hyper-parameters and
    ``params`` becomes a LocalNonpersistentObject. Works before the first step: missing state
    is materialised in ``optimizer`` as Adam itself would (zeros, step 0). The ShardedTensors
    share memory with the live state, so the result serves as a save or a load template.
    ``model_sharded``: ``model.sharded_state_dict()`` where the caller already built it (as
    megatron's ``optimizer.sharded_state_dict(model_sharded_state_dict)`` takes it), read
    only: a save then builds the model's dict once, not twice.
    """
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(f"expected torch.optim.Adam (state layout is Adam's), got {optimizer!r}")
    _materialise_adam_state(optimizer)
    live = optimizer.state_dict()
    # Copy the structure: live["state"][i] are the optimizer's own per-parameter dicts.
    state = {pid: dict(s) for pid, s in live["state"].items()}
    steps = {pid: s.pop("step") for pid, s in state.items()}
    common_step = next(iter(steps.values()), None)
    if any(
        not torch.equal(torch.as_tensor(s), torch.as_tensor(common_step)) for s in steps.values()
    ):
        raise ValueError("Adam step differs between parameters; only a common step is supported")
    sharded = {"state": state, "param_groups": live["param_groups"]}
    if model_sharded is None:
        model_sharded = model.sharded_state_dict()
    id_map = get_param_id_to_sharded_param_map(
        model_sharded, chain.from_iterable(g["params"] for g in optimizer.param_groups)
    )
    optim_state_to_sharding_state(sharded, id_map)  # deep-copies param_groups
    if common_step is not None:
        sharded["state"]["common_step"] = copy.deepcopy(common_step)
    return sharded


def load_optimizer_state(model: GPTModel, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    """Install a state loaded (``dist_checkpointing.load``) from ``optimizer_sharded_state_dict``.

    Every parameter gets its own copy of ``common_step``: Adam increments ``step`` in place,
    so a shared tensor would be advanced once per parameter on each step.
    """
    state = dict(loaded["state"])
    common_step = state.pop("common_step", None)
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    if n_params != len(list(model.parameters())):
        raise ValueError("optimizer does not cover exactly the model's parameters")
    if len(state) != n_params:
        raise ValueError(f"loaded state has {len(state)} entries for {n_params} parameters")
    per_param = {}
    for pid, moments in state.items():
        per_param[pid] = dict(moments)
        if common_step is not None:
            per_param[pid]["step"] = copy.deepcopy(common_step)
    groups = copy.deepcopy(loaded["param_groups"])
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def causal_batch(cfg: TinyGPTConfig, batch_size: int, generator: torch.Generator) -> Batch:
    """Random next-token batch ``(tokens, position_ids, attention_mask, labels)``, [b, s] each.

    Every TP rank must get the same batch: seed ``generator`` identically on all of them. The
    mask is an explicit causal mask [1, 1, s, s] (True = masked) on CPU, None on CUDA (megatron
    builds it there).
    """
    s = cfg.seq_length
    seq = torch.randint(0, cfg.vocab_size, (batch_size, s + 1), generator=generator)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(batch_size, s).contiguous()
    if _cuda():
        dev = torch.cuda.current_device()
        return tokens.to(dev), position_ids.to(dev), None, labels.to(dev)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    return tokens, position_ids, mask, labels


def compute_loss(model: GPTModel, batch: Batch) -> torch.Tensor:
    """Mean next-token loss (a scalar, identical on all TP ranks) of ``model`` on ``batch``."""
    tokens, position_ids, attention_mask, labels = batch
    b, s = tokens.shape
    reserve_cpu_attention_buffer(
        b * model.config.num_attention_heads * s * s, model.config.params_dtype
    )
    per_token = model(tokens, position_ids, attention_mask, labels=labels)
    return per_token.float().mean()


def train_step(model: GPTModel, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    """One step: forward with labels, backward, ``optimizer.step()``, zero grads; the loss.

    No gradient all-reduce is needed across TP ranks: megatron's TP layers already give
    replicated parameters (layer norms, row-parallel biases) the same gradient on every rank.
    """
    model.train()
    loss = compute_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def causal_inputs(
    model: GPTModel, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(tokens, position_ids, attention_mask)`` for a causal forward of ``model`` on [b, s].

    Positions 0..s-1 for every row; the mask is explicit and on CPU (True = masked), None on
    CUDA where megatron builds it. The attention scratch buffer is sized for [b, s] first.
    """
    b, s = tokens.shape
    position_ids = torch.arange(s, dtype=torch.long, device=tokens.device).expand(b, s)
    if _cuda():
        return tokens, position_ids.contiguous(), None
    reserve_cpu_attention_buffer(
        b * model.config.num_attention_heads * s * s, model.config.params_dtype
    )
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    return tokens, position_ids.contiguous(), mask


@torch.no_grad()
def gather_vocab_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from the tensor-parallel shards [..., vocab / tp] (no gradient).

    megatron's ``gather_from_tensor_model_parallel_region`` allocates its output on
    ``torch.cuda.current_device()``; this all-gathers on the tensor's own device.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    shards = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(
        shards, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(shards, dim=-1)
