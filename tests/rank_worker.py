"""A Megatron rank in a Ray actor, as an RL trainer has them: a tiny real GPTModel, a torch
Adam with megatron-core sharded optimizer state, and a CheckpointManager."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import ray
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex")


@ray.remote(num_cpus=0)
class RankWorker:
    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        tp: int,
        seed: int = 7,
        save_ranks: list[int] | None = None,
    ):
        """`save_ranks`: the ranks of this gloo world that save (others are rollout-like
        ranks that never do); None: every rank saves, on the default group. The rank joins
        its world in `join` (see `start_world`)."""
        from recipes import megatron_cpu

        self.mc = megatron_cpu
        self.role = role
        self._world = (rank, world_size, tp, seed, save_ranks)
        self._store = None
        self.manager = None
        self._conversion_hold: dict[str, Any] | None = None  # hold_shard_conversion

    def open_rendezvous(self) -> int:
        """Rank 0: host the world's rendezvous on a loopback port that stays bound; its port."""
        self._store = self.mc.host_rendezvous(self._world[1])
        return self._store.port

    def store_port(self) -> int:
        """Rank 0: the port of the world's store (what its errors name)."""
        return self._store.port

    def join(self, port: int) -> None:
        """Join the world whose rank 0 listens on `port`; build the model and optimizer."""
        from datetime import timedelta

        import torch.distributed as dist

        rank, world_size, tp, seed, save_ranks = self._world
        store = self._store if rank == 0 else self.mc.join_rendezvous(port, world_size)
        self.mc.init_distributed(rank, world_size, store=store, tensor_parallel_size=tp, seed=seed)
        self.group = None
        self.rank, self.world_size = rank, world_size
        if save_ranks is not None:
            # new_group is collective over the whole world, savers or not.
            self.group = dist.new_group(save_ranks, timeout=timedelta(seconds=60))
            if rank in save_ranks:
                self.rank, self.world_size = save_ranks.index(rank), len(save_ranks)
        self.cfg = self.mc.TinyGPTConfig()
        self.model = self.mc.build_tiny_gpt(self.cfg, seed=seed)
        self.optimizer = self.mc.make_adam(self.model)
        self.generator = torch.Generator().manual_seed(seed)
        # Saved with the extra state as the same list object every time: a trainer's own
        # counters, which it changes in place after save() (after="extra").
        self.counter = [0]

    def rebuild(self, hidden_size: int, seed: int = 7, tied_embeddings: bool = False) -> None:
        """A new model of another shape (and its optimizer): the saved structure changes.
        `tied_embeddings`: the output layer reuses the word embeddings (GPT-2's layout)."""
        import dataclasses

        self.cfg = dataclasses.replace(
            self.cfg, hidden_size=hidden_size, share_embeddings_and_output_weights=tied_embeddings
        )
        self.model = self.mc.build_tiny_gpt(self.cfg, seed=seed)
        self.optimizer = self.mc.make_adam(self.model)
        self.train(1)

    def save_another_structure(self, step: int) -> dict[str, Any]:
        """A save whose structure is not save()'s: one more tensor in the model's dict."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        model = self.model.sharded_state_dict()
        model["probe"] = ShardedTensor.from_rank_offsets("probe", torch.zeros(4))
        return vars(
            self.manager.save(
                step,
                model=model,
                optimizer=self.mc.optimizer_sharded_state_dict(self.model, self.optimizer),
            )
        )

    def save_uncopyable_extra(self, step: int) -> dict[str, Any]:
        """A save of save()'s structure whose extra state cannot be copied (it holds a lock):
        save() fails after the save group's layout, on the training thread."""
        import threading

        return vars(
            self.manager.save(
                step,
                model=self.model.sharded_state_dict(),
                optimizer=self.mc.optimizer_sharded_state_dict(self.model, self.optimizer),
                extra={"lock": threading.Lock()},
            )
        )

    def placement(self) -> dict[str, str]:
        """Where this rank's state lives and which backend its group has (the CUDA tests)."""
        import torch.distributed as dist

        moments = [s["exp_avg"] for s in self.optimizer.state.values()]
        return {
            "backend": str(dist.get_backend(self.group)),
            "parameters": str(next(self.model.parameters()).device),
            "optimizer": str(moments[0].device),
        }

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()

    def open_manager(self, config: dict) -> None:
        from verl_ckpt import CheckpointManager

        if self.manager is not None:
            self.manager.close()
        if getattr(self, "_fence_hook", None) is not None:
            self._fence_hook.remove()
            self._fence_hook = None
        self.manager = CheckpointManager(
            config, self.role, self.rank, self.world_size, process_group=self.group
        )

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            batch = self.mc.causal_batch(self.cfg, 4, self.generator)
            losses.append(self.mc.train_step(self.model, self.optimizer, batch))
        return losses

    def state_copy(self) -> dict[str, torch.Tensor]:
        """Every tensor of model and optimizer, copied to host memory (what a correct load must
        restore)."""
        state = {
            f"model.{k}": v.detach().to("cpu", copy=True)
            for k, v in self.model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        for i, (param, s) in enumerate(self.optimizer.state.items()):
            del param
            for name, value in s.items():
                state[f"optim.{i}.{name}"] = value.detach().to("cpu", copy=True)
        return state

    def save(
        self, step: int, after: str | bool = "nothing", snapshot: str | None = None
    ) -> dict[str, Any]:
        """Save, then at once do what a trainer may do next (invariant I4):
        `inplace`: in-place writes to every parameter and optimizer tensor, then a step;
        `offload`: offload the optimizer state (replace its storage by a host copy, as verl
        does), train a step on reloaded state, offload again, and drop the old tensors;
        `fence, inplace`: fence() first (the deferred snapshot's contract), then `inplace`;
        `step`: one training step (its optimizer.step() may fence through fence_before);
        `extra`: change the counter saved in the extra state in place;
        `optimizer inplace`: in-place writes to every optimizer tensor only;
        `quiet, data`: inside quiet(), change the optimizer state through `.data`;
        `swap data`: no fence, bind new tensors to every parameter's and optimizer tensor's
        `.data` (a move to another device and back, an EMA swap), leaving the old ones as
        they were."""
        from verl_ckpt import describe_gpt_model

        self.counter[0] = step
        extra = {
            "rng": torch.get_rng_state(),
            "generator": self.generator.get_state(),
            "counter": self.counter,
        }
        hold = self._conversion_hold
        if hold is not None:
            hold["trainer"] = threading.get_ident()
        try:
            stats = self.manager.save(
                step,
                model=self.model.sharded_state_dict(),
                optimizer=self.mc.optimizer_sharded_state_dict(self.model, self.optimizer),
                extra=extra,
                snapshot=snapshot,
                model_spec=describe_gpt_model(self.model),
            )
        finally:
            if hold is not None:
                hold["returned"].set()
        if after == "extra":
            self.manager.fence()  # the deferred snapshot's contract (a no-op for "now")
            self.counter[0] = -1
        if after == "quiet, data":
            # An update that bumps no version counter (through `.data`, as a C++ kernel or a
            # numpy view would), inside quiet(), as an optimizer step under fence_before.
            with self.manager.quiet(), torch.no_grad():
                for s in self.optimizer.state.values():
                    for value in s.values():
                        value.data.mul_(3.0)
        if after == "optimizer inplace":
            with torch.no_grad():
                for s in self.optimizer.state.values():
                    for value in s.values():
                        value.mul_(3.0)
        if after == "swap data":
            # Rebinding `.data` moves no version counter: the save must hold on to the tensors
            # it saw at save() (I4).
            with torch.no_grad():
                for value in self._every_state_tensor():
                    value.data = torch.full_like(value, 7.0)
        if after == "fence, inplace":
            self.manager.fence()
            after = "inplace"
        if after == "step":
            self.train(1)
        if after in (True, "inplace"):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)
                for s in self.optimizer.state.values():
                    for value in s.values():
                        value.mul_(3.0)
            self.train(1)
        elif after == "offload":
            self._swap_optimizer_storage()  # offload
            self._swap_optimizer_storage()  # reload before the update
            self.train(1)
            self._swap_optimizer_storage()  # offload after it
        return vars(stats)

    def _every_state_tensor(self) -> list[torch.Tensor]:
        moments = [v for s in self.optimizer.state.values() for v in s.values()]
        return [*self.model.parameters(), *moments]

    def save_with_a_large_moment(
        self, step: int, in_page: int, snapshot: str | None = None
    ) -> dict[str, Any]:
        """save(step) with one more optimizer tensor, of 1 MiB or more, whose storage of its
        own starts `in_page` bytes into a page of memory: an offloading trainer's optimizer
        tensor, re-allocated at every step wherever torch's allocator finds room (at any
        multiple of 64 bytes). Real memory (an anonymous mapping, which starts on a page),
        placed by hand; the tensor keeps its mapping alive."""
        import mmap

        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        from verl_ckpt.format.torch_format import PAGE_ALIGNED_MIN, PAGE_BYTES

        numel = PAGE_ALIGNED_MIN // 4 + 3
        memory = mmap.mmap(-1, numel * 4 + PAGE_BYTES)
        moment = torch.frombuffer(memory, dtype=torch.float32, count=numel, offset=in_page)
        moment.copy_(torch.arange(numel, dtype=torch.float32))
        optimizer = self.mc.optimizer_sharded_state_dict(self.model, self.optimizer)
        optimizer["large_moment"] = ShardedTensor.from_rank_offsets(
            "optimizer.large_moment", moment, (0, self.rank, self.world_size)
        )
        stats = self.manager.save(
            step,
            model=self.model.sharded_state_dict(),
            optimizer=optimizer,
            extra={"rng": torch.get_rng_state(), "generator": self.generator.get_state()},
            snapshot=snapshot,
        )
        return vars(stats)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The model's full-vocabulary logits [b, s, vocab] on `tokens` [b, s] (gathered over
        the tensor-parallel ranks; every rank returns the same)."""
        self.model.eval()
        try:
            shards = self.model(*self.mc.causal_inputs(self.model, tokens))
            return self.mc.gather_vocab_logits(shards).clone()
        finally:
            self.model.train()

    def _swap_optimizer_storage(self) -> None:
        for s in self.optimizer.state.values():
            for name, value in list(s.items()):
                s[name] = value.detach().to("cpu", copy=True)

    def forget_write_resolution(self) -> None:
        """Fault injection: the next save on the cached plan converts the staged state for
        DCP, as a save did before it learned where its write items are
        (format/write_resolution.py), or as one does whose shards are placed otherwise."""
        import dataclasses

        planner = self.manager._planner
        planner._plan_cache = dataclasses.replace(planner._plan_cache, resolution=None)

    def hold_shard_conversion(self, hold: bool) -> bool | None:
        """Fault injection (a thread interleaving cannot be forced for real), for the next
        save() whose plan runs on the save thread: the save's copy into its staging buffers
        waits (up to 30 s) until the save thread is converting a sharded tensor with
        prepended axes (a layer's weights, stacked over layers) into torch's ShardedTensor,
        and that conversion pauses, after its view of each shard's data (`sh_ten.data` with
        the prepended axes) and before its last use of it, until save() has returned.
        Released (`hold=False`): whether a conversion was held until save() returned."""
        from torch.distributed._shard.sharded_tensor import Shard

        from verl_ckpt.rank import snapshotter as manager

        if not hold:
            state, self._conversion_hold = self._conversion_hold, None
            if state is None:
                return None
            Shard.from_tensor_and_offsets = state["original_shard"]
            manager.copy_into = state["original_copy"]
            return state["held"]
        original_shard = Shard.__dict__["from_tensor_and_offsets"]
        original_copy = manager.copy_into
        state = {
            "original_shard": original_shard,
            "original_copy": original_copy,
            "converting": threading.Event(),
            "returned": threading.Event(),
            "held": False,
            "trainer": threading.get_ident(),
        }

        def from_tensor_and_offsets(cls, tensor, shard_offsets, rank):
            if threading.get_ident() != state["trainer"] and not state["returned"].is_set():
                state["converting"].set()
                state["held"] = state["returned"].wait(60)
            return original_shard.__func__(cls, tensor, shard_offsets, rank)

        def copy_into(*args, **kwargs):
            state["converting"].wait(30)
            return original_copy(*args, **kwargs)

        Shard.from_tensor_and_offsets = classmethod(from_tensor_and_offsets)
        manager.copy_into = copy_into
        self._conversion_hold = state
        return None

    def fail_the_next_plan_after_its_gather(self) -> None:
        """Fault injection (a fault that cannot be produced at that moment for real: memory
        running out on one rank after the plan's gather, say): this rank's next plan over
        the group raises once the gather is over, its peers' plans having succeeded."""
        from verl_ckpt.format import megatron_compat

        original = megatron_compat.WriteResolution

        class FailsOnce:
            @staticmethod
            def learn(*args: Any, **kwargs: Any) -> Any:
                megatron_compat.WriteResolution = original
                raise MemoryError("injected after the plan's gather")

        megatron_compat.WriteResolution = FailsOnce

    def fail_the_next_conversion(self) -> None:
        """Fault injection (a fault that cannot be produced at that moment for real): this
        rank's next plan over the group raises in its local conversion, before its gather
        (a shard megatron-core cannot convert on this rank only, say)."""
        from verl_ckpt.format import megatron_compat

        original = megatron_compat.see_shards

        def fails_once(*args: Any, **kwargs: Any) -> Any:
            megatron_compat.see_shards = original
            raise ValueError("injected in the plan's local conversion")

        megatron_compat.see_shards = fails_once

    def save_live_with_its_writes_held(self, step: int) -> list[str]:
        """Fault injection (a disk that stalls past a save's deadline cannot be produced here
        for real): close this rank's write gate (the one quiet() closes) so that its writer
        threads stall in the write, save `step` with snapshot=live, then fence() (by its
        default deadline), and fence() again (for 1 s) while they are still held; then let
        the writes go and fence() (for up to 30 s), and once more. Returns what each fence()
        raised, or "fence returned"."""
        writer = self.manager._writer
        writer.pause()
        try:
            self.save(step, snapshot="live")
            fences = [self._fence_outcome(None), self._fence_outcome(1.0)]
        finally:
            writer.resume()
        return [*fences, self._fence_outcome(30.0), self._fence_outcome(1.0)]

    def _fence_outcome(self, timeout_s: float | None) -> str:
        from verl_ckpt import CommitTimeoutError

        try:
            self.manager.fence(timeout_s)
        except CommitTimeoutError as exc:
            return str(exc)
        return "fence returned"

    def save_through_ctrl_c(self, step: int) -> str:
        """save(step) in a trainer that catches Ctrl-C (KeyboardInterrupt) and goes on; the
        interrupt itself comes from VERL_CKPT_FAULT's `interrupt` (a SIGINT does not reach
        a Ray actor's calls). Returns "KeyboardInterrupt" or "saved"."""
        try:
            self.save(step)
            return "saved"
        except KeyboardInterrupt:
            return "KeyboardInterrupt"

    def set_env(self, name: str, value: str | None) -> None:
        import os

        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def process_info(self) -> dict[str, Any]:
        """This rank's resident memory and the live child processes it started."""
        import psutil

        me = psutil.Process()
        children = [
            (c.pid, " ".join(c.cmdline())[:200])
            for c in me.children(recursive=True)
            if c.status() != "zombie"
        ]
        return {"rss": me.memory_info().rss, "children": children}

    def thread_count(self) -> int:
        import psutil

        return psutil.Process().num_threads()

    def manager_threads(self) -> list[str]:
        """The live threads that this rank's checkpoint managers started (named after the
        rank): unlike the process's thread count, blind to threads of Ray or of other
        components ending meanwhile."""
        import threading

        prefix = f"verl_ckpt_{self.role}{self._world[0]}_"
        return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefix))

    def threads_once_agreement_formed(self) -> int:
        """This process's thread count once the open manager's agreement group is formed
        (formed on the agreement's thread at open; its future is private, read here only)."""
        self.manager._agreement._forming.result(timeout=60)
        return self.thread_count()

    def staged_bytes(self) -> int:
        return self.manager.staged_bytes

    def writer_pid(self) -> int | None:
        return self.manager.writer_pid

    def wait(self, timeout_s: float | None = None) -> list[dict]:
        return [vars(s) for s in self.manager.wait(timeout_s)]

    def prepare(self, without_optimizer: bool = False) -> None:
        """prepare(); `without_optimizer`: a trainer's mistake (the optimizer is saved)."""
        optimizer = self.mc.optimizer_sharded_state_dict(self.model, self.optimizer)
        self.manager.prepare(
            model=self.model.sharded_state_dict(),
            optimizer=None if without_optimizer else optimizer,
            extra={"rng": torch.get_rng_state(), "generator": self.generator.get_state()},
        )

    def fence_before_optimizer_steps(self) -> None:
        self._fence_hook = self.manager.fence_before(self.optimizer)

    def close(self, timeout_s: float | None = None) -> None:
        if self.manager is not None:
            manager, self.manager = self.manager, None
            manager.close(timeout_s)

    def moment_shapes(self) -> list[tuple[int, ...]]:
        """The shape of Adam's exp_avg of each parameter, in optimizer order."""
        return [tuple(s["exp_avg"].shape) for s in self.optimizer.state.values()]

    def set_moment_layout(self, views: list[int]) -> None:
        """Give Adam's exp_avg of the parameters at `views` storage it shares with more data
        (a view: offload-aware staging copies it) and the others a storage of their own
        (written live, without a copy), as an offloading trainer's allocator might."""
        for index, state in enumerate(self.optimizer.state.values()):
            value = state["exp_avg"].detach()
            if index in views:
                backing = torch.empty(value.numel() + 1, dtype=value.dtype)
                view = backing[1:].view(value.shape)
                view.copy_(value)
                state["exp_avg"] = view
            else:
                state["exp_avg"] = value.clone()

    def load(self, step_path: Any) -> dict[str, Any]:
        """Restore model, optimizer and RNG from a committed step, as a resuming trainer does.
        Returns the load's LoadStats (as a dict) and how many tensors its templates hold."""
        from dataclasses import asdict

        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        templates = {
            "model": self.model.sharded_state_dict(),
            "optimizer": self.mc.optimizer_sharded_state_dict(self.model, self.optimizer),
        }
        tensors = sum(isinstance(v, ShardedTensor) for v in nested_values(templates))
        loaded = self.manager.load(step_path, **templates)
        self.model.load_state_dict(loaded["model"])
        self.mc.load_optimizer_state(self.model, self.optimizer, loaded["optimizer"])
        torch.set_rng_state(loaded["extra"]["rng"])
        self.generator.set_state(loaded["extra"]["generator"])
        self.counter[:] = loaded["extra"]["counter"]
        return {"stats": asdict(self.manager.last_load), "tensors": tensors}

    def counter_value(self) -> list[int]:
        return list(self.counter)

    def load_model_and_optimizer(self, step_path: Any) -> None:
        """Restore model and optimizer only (no per-rank extra state)."""
        loaded = self.manager.load(
            step_path,
            model=self.model.sharded_state_dict(),
            optimizer=self.mc.optimizer_sharded_state_dict(self.model, self.optimizer),
            extra=False,
        )
        self.model.load_state_dict(loaded["model"])
        self.mc.load_optimizer_state(self.model, self.optimizer, loaded["optimizer"])

    def plain_megatron_load(self, role_dir: str) -> dict[str, torch.Tensor]:
        """Invariant I7: megatron-core alone, no code of ours, reads the role directory."""
        from megatron.core import dist_checkpointing

        template = {"model": self.model.sharded_state_dict()}
        loaded = dist_checkpointing.load(template, role_dir)
        return {
            f"model.{k}": v.to("cpu", copy=True)
            for k, v in loaded["model"].items()
            if isinstance(v, torch.Tensor)
        }

    def limit_file_size(self, nbytes: int | None) -> None:
        """Cap the size of files this process writes (RLIMIT_FSIZE): writes past the cap fail
        with EFBIG, as on a full disk. A real OS limit, no fake. None lifts the cap."""
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of the process
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        soft = resource.RLIM_INFINITY if nbytes is None else nbytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# How long a world of rank workers may take to start and join (Ray starts their processes,
# each imports megatron-core): a deadline for a loaded 2-core machine.
WORLD_STARTUP_S = 300


def start_world(
    role: str,
    world_size: int,
    tp: int,
    options: Callable[[int], dict] | None = None,
    **worker_args: Any,
) -> list:
    """The ranks of one gloo world, joined. Rank 0 hosts the rendezvous on a port it binds
    and keeps (`megatron_cpu.host_rendezvous`); the others join that port. Choosing a free
    port, closing it and binding it again in rank 0 was a race that lost in CI: any process
    on the machine (an outgoing connection's ephemeral port) could take it in between.
    `options(rank)`: Ray actor options for that rank (resources, GPUs)."""
    workers = [
        RankWorker.options(**(options(rank) if options else {})).remote(
            role, rank, world_size, tp, **worker_args
        )
        for rank in range(world_size)
    ]
    port = ray.get(workers[0].open_rendezvous.remote(), timeout=WORLD_STARTUP_S)
    ray.get([w.join.remote(port) for w in workers], timeout=WORLD_STARTUP_S)
    return workers
