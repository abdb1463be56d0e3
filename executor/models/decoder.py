"""The decoder forward shared by Qwen3 and Qwen3.5: embed, layers, final norm,
lm_head and sampling (greedy, temperature, top-k, top-p), over the planned buffers.

The model holds its layers twice, once per projections backend (projections.py), and a step runs
one of them throughout. GEMM layers: the residual stream ``hidden`` is accumulated in place by
the fused add + RMSNorm kernel between blocks; ``normed`` is each block's input and ``proj_out``
each block's output (see planner.step_buffers for the stages and live ranges). GEMV layers
(decode steps of at most the plan's ``decode_gemv_batch`` requests, graphs included): each
block's first projection normalizes ``hidden`` and its last adds into it, so a layer is its two
blocks and nothing between them; the final norm and lm_head are one more such projection, which
writes the float32 logits itself. (On the H200, batch 1, Qwen3-8B: cuBLAS took 294.6-294.8 us for
lm_head, after a 3.9 us norm launch and a 2.2 us gather and before a 3.5-3.6 us copy to float32; the
GEMV took 272.8 us for all four; docs/benchmarks.md, "Decode step profile".)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.arena import Arena
from executor.models.blocks import Mixer, Mlp
from executor.models.context import StepViews, bucket_views, step_views
from executor.models.graphs import DecodeGraphs, PrefillGraphs
from executor.models.launchers import Kernels, NormStyle
from executor.models.projections import GemmProjections, GemvProjections, Projections
from executor.parallel import TensorParallel
from executor.step import StepMetadata, decode_grid_tiles, pad_decode
from executor.step_writer import StepWriter

Block = Callable[[StepViews], None]
#: A model's mixer of layer ``index`` (attention or linear attention) on the given projections.
MixerBuilder = Callable[[int, Projections], Mixer]


@dataclass(frozen=True)
class Layer:
    mixer: Mixer  # attention or linear attention, on the layer's projections (projections.py)
    mlp: Block
    input_norm: torch.Tensor  # the GEMM forward's add + RMSNorm weights (GEMV projections hold their own)
    post_norm: torch.Tensor


class DecoderModel:
    """A decoder over an arena. ``step(meta)`` runs one forward and samples a token for each request."""

    def __init__(self, arena: Arena, kernels: Kernels, norm: NormStyle, build_mixer: MixerBuilder,
                 parallel: TensorParallel | None = None):
        self.arena, self.kernels, self.norm = arena, kernels, norm
        self.device = arena.device
        self.eps = arena.plan.model.rms_norm_eps
        geometry = arena.plan.geometry
        # None without peers: tp 1, or a tp > 1 plan built alone (kernel discovery), which runs no collective.
        self.parallel = parallel if parallel is not None and parallel.world_size > 1 else None
        self.announce = self.parallel.announce if self.parallel is not None and self.parallel.is_driver else None
        self.tensor_parallel_size = geometry.tensor_parallel_size
        self.vocab = arena.plan.model.vocab_size
        self.first_id = geometry.vocab_slices[arena.rank][0] if geometry.vocab_slices else 0
        num_layers, self.gemv_batch = geometry.num_layers, arena.plan.capacity.decode_gemv_batch
        gemm = GemmProjections(kernels, self.parallel)
        self.layers = tuple(self._layer(i, build_mixer, gemm) for i in range(num_layers))
        self.gemv_layers = (tuple(self._layer(i, build_mixer, None) for i in range(num_layers))
                            if self.gemv_batch else ())
        self.embed = arena.tensor("weights", "model.embed_tokens.weight")
        self.final_norm = arena.tensor("weights", "model.norm.weight")
        tied = arena.plan.model.tie_word_embeddings
        self.lm_head = self.embed if tied else arena.tensor("weights", "lm_head.weight")
        # The GEMV steps' final RMSNorm + lm_head: one fused GEMV, like a block's first projection.
        self.gemv_head = GemvProjections(kernels, self.final_norm, norm, self.eps) if self.gemv_batch else None
        self.logits_raw = arena.tensor("sampling", "logits_raw")
        self.writer = StepWriter(arena)
        # The last step's sampled ids, which a token id -(r + 1) names (kernels/rows/embedding.py): the
        # embedding reads them before this step's sampler overwrites them (stream order).
        self.previous_ids = arena.tensor("sampling", "sampled_ids")
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    def _layer(self, index: int, build_mixer: MixerBuilder, gemm: GemmProjections | None) -> Layer:
        """Layer ``index`` on the shared GEMM projections, or (``gemm`` None) on GEMV projections that
        normalize with the layer's input and post-attention norm weights."""
        weight = lambda name: self.arena.tensor("weights", f"model.layers.{index}.{name}.weight")  # noqa: E731
        input_norm, post_norm = weight("input_layernorm"), weight("post_attention_layernorm")
        mixer_proj = gemm or GemvProjections(self.kernels, input_norm, self.norm, self.eps, self.parallel)
        mlp_proj = gemm or GemvProjections(self.kernels, post_norm, self.norm, self.eps, self.parallel)
        return Layer(mixer=build_mixer(index, mixer_proj), mlp=Mlp(self.arena, mlp_proj, index),
                     input_norm=input_norm, post_norm=post_norm)

    def capture_decode_graphs(self) -> None:
        """Capture one decode CUDA graph per bucket of the serving config (CUDA only; once, after
        the weights are loaded). Later decode steps of at most the largest bucket replay them."""
        if self.device.is_sim:
            raise RuntimeError("the Numba CUDA simulator has no CUDA graphs; run decode eagerly")
        if self.announce is not None:
            self.announce(("capture_decode_graphs",))
        graphs = DecodeGraphs(self.arena, self.writer, self._forward, self.arena.plan.serving.decode_graph_batch_sizes)
        graphs.capture()
        self.graphs = graphs

    def capture_prefill_graphs(self) -> None:
        """Capture the pieces of prefill steps at each of the plan's row buckets (capacity.prefill_graph_rows;
        CUDA only, once, after the weights are loaded; none with tensor parallelism, whose collectives stay
        eager). Later prefill steps of at most the largest bucket replay them between their eager attention."""
        if self.device.is_sim:
            raise RuntimeError("the Numba CUDA simulator has no CUDA graphs; run prefill eagerly")
        buckets = self.arena.plan.capacity.prefill_graph_rows
        if not buckets or self.parallel is not None:
            return
        graphs = PrefillGraphs(self.arena, self._piece, len(self.layers) + 1, buckets)
        graphs.capture()
        self.prefill_graphs = graphs

    def step(self, meta: StepMetadata, pad_to: int | None = None) -> torch.Tensor:
        """Copy the step's metadata in place, run the forward, and return the sampled ids view [B] int32.

        A decode step replays the captured graph of the smallest bucket that holds it, if any;
        otherwise it runs eagerly, padded to ``pad_to`` requests when given (exactly what a
        graph of that bucket records: tests compare the two). The returned view is the planned
        ``sampled_ids`` buffer: read it before the next step.
        """
        if self.announce is not None:
            self.announce(("step", meta, pad_to))
        graphs = self.graphs if meta.pool == "decode" else None
        bucket = graphs.bucket_for(meta.num_requests) if graphs is not None else None
        if bucket is not None:
            graphs.replay(meta, bucket)
        elif pad_to is not None:
            self.writer.write(pad_decode(self.arena.plan, meta, pad_to))
            self._forward(bucket_views(self.arena, pad_to, decode_grid_tiles(self.arena.plan, pad_to)))
        else:
            self.writer.write(meta)
            self._forward(step_views(self.arena, meta))
        return self.arena.tensor("sampling", "sampled_ids")[: meta.num_requests]

    def reset_slot(self, slot: int) -> None:
        """Zero a recurrent-state slot (conv and delta-rule state of every linear layer) for a new request."""
        if self.announce is not None:
            self.announce(("reset_slot", slot))
        if self.arena.plan.geometry.num_linear_layers:
            self.arena.tensor("recurrent_state", "ssm_state")[:, slot].zero_()
            self.arena.tensor("recurrent_state", "conv_state")[:, slot].zero_()

    def copy_slot(self, source: int, target: int) -> None:
        """Copy recurrent-state slot ``source`` into ``target`` (a prefix-cache snapshot taken or restored),
        on the step stream: in order with the steps before and after it."""
        if self.announce is not None:
            self.announce(("copy_slot", source, target))
        for name in ("ssm_state", "conv_state"):
            state = self.arena.tensor("recurrent_state", name)
            state[:, target].copy_(state[:, source])

    def logits(self, num_requests: int) -> torch.Tensor:
        """The last step's float32 logits [B, V] over the whole vocabulary (a view of the planned buffer)."""
        return self.arena.tensor("sampling", "logits")[:num_requests, : self.vocab]

    def _forward(self, step: StepViews) -> None:
        """One forward over ``step``'s views, with the projections backend the plan gives its size."""
        if step.pool == "decode" and step.num_requests <= self.gemv_batch:
            self._forward_gemv(step)
        else:
            self._forward_gemm(step)

    def _embed(self, step: StepViews) -> None:
        """The step's token rows into ``hidden``: the rows this rank's table holds, summed over the ranks."""
        hidden = step.role("hidden")
        self.kernels.embedding(step.role("token_ids"), self.embed, hidden, self.previous_ids, stream=step.stream,
                               first_id=self.first_id, vocab=self.vocab)
        if self.parallel is not None:
            self.parallel.all_reduce_(hidden)

    def _logit_shards(self, step: StepViews) -> torch.Tensor:
        """tp > 1: the step's [tp, n, Vs] view of ``logits_raw`` (its first tp x n x Vs elements)."""
        n, rows = step.num_requests, self.logits_raw.shape[-1]
        return self.logits_raw.view(-1)[: self.tensor_parallel_size * n * rows].view(self.tensor_parallel_size, n, rows)

    def _gather_logits(self, step: StepViews, shards: torch.Tensor) -> None:
        """tp > 1: every rank's shard of the logits into ``shards``, then into ``logits`` in vocabulary order."""
        if self.parallel is not None:
            self.parallel.all_gather_(shards.view(-1), shards[self.arena.rank].view(-1))
        n, tp, rows = step.num_requests, self.tensor_parallel_size, shards.shape[-1]
        self._sampling(step, "logits").view(n, tp, rows).copy_(shards.permute(1, 0, 2))

    def _forward_gemv(self, step: StepViews) -> None:
        self._embed(step)
        for layer in self.gemv_layers:
            layer.mixer(step)
            layer.mlp(step)
        # A decode step's rows are its requests' last rows (logits_indices 0 .. B - 1): no gather; the
        # final norm runs in the lm_head GEMV's prologue, which writes the float32 logits itself (its
        # shard of them in the activation dtype, with tensor parallelism).
        if self.tensor_parallel_size == 1:
            self.gemv_head.normed(step, self.lm_head, self._sampling(step, "logits"))
        else:
            shards = self._logit_shards(step)
            self.gemv_head.normed(step, self.lm_head, shards[self.arena.rank])
            self._gather_logits(step, shards)
        self._sample(step)

    def _forward_gemm(self, step: StepViews) -> None:
        """The GEMM forward: the embedding, then the pieces (``_piece``) with each layer's attention between
        them, then the lm_head. A prefill step of at most the largest prefill-graph bucket replays its
        bucket's pieces instead of launching them."""
        graphs = self.prefill_graphs if step.pool == "prefill" else None
        bucket = graphs.bucket_for(step.num_rows) if graphs is not None else None
        if bucket is not None:
            step = dataclasses.replace(step, piece_rows=bucket)
        self._embed(step)
        for index, layer in enumerate(self.layers):
            self._run_piece(index, step, bucket)
            layer.mixer.attend(step)
        self._run_piece(len(self.layers), step, bucket)
        self._head(step)

    def _run_piece(self, index: int, step: StepViews, bucket: int | None) -> None:
        if bucket is None:
            self._piece(index, step)
        else:
            self.prefill_graphs.replay(bucket, index)

    def _piece(self, index: int, step: StepViews) -> None:
        """Piece ``index`` (0 .. num_layers) of the GEMM forward, the row-wise work between two attentions:
        layer ``index - 1``'s mixer output, post-attention norm and MLP, then layer ``index``'s input norm
        and input projection (the final norm after the last layer)."""
        k_, stream, offset = self.kernels, step.stream, self.norm.weight_offset
        hidden, normed, proj_out = step.role("hidden"), step.role("normed"), step.role("proj_out")
        if index == 0:
            k_.rms_norm(hidden, self.layers[0].input_norm, normed, self.eps, offset, stream=stream)
        else:  # hidden += the block's output; normed = norm(hidden)
            before = self.layers[index - 1]
            before.mixer.finish(step)
            k_.add_rms_norm(proj_out, hidden, before.post_norm, normed, self.eps, offset, stream=stream)
            before.mlp(step)
            norm = self.layers[index].input_norm if index < len(self.layers) else self.final_norm
            k_.add_rms_norm(proj_out, hidden, norm, normed, self.eps, offset, stream=stream)
        if index < len(self.layers):
            self.layers[index].mixer.project(step)

    def _head(self, step: StepViews) -> None:
        """The requests' last rows of ``normed`` through lm_head, then sampling."""
        normed = step.role("normed")
        last_hidden = self._sampling(step, "last_hidden")
        torch.index_select(normed, 0, self._sampling(step, "logits_indices"), out=last_hidden)
        if self.tensor_parallel_size == 1:
            logits_raw = self._sampling(step, "logits_raw")
            torch.matmul(last_hidden, self.lm_head.t(), out=logits_raw)
            self._sampling(step, "logits").copy_(logits_raw)
        else:
            shards = self._logit_shards(step)
            torch.matmul(last_hidden, self.lm_head.t(), out=shards[self.arena.rank])
            self._gather_logits(step, shards)
        self._sample(step)

    def _sampling(self, step: StepViews, name: str) -> torch.Tensor:
        """The step's rows of the planned sampling buffer ``name``."""
        return self.arena.tensor("sampling", name)[: step.num_requests]

    def _sample(self, step: StepViews) -> None:
        """Sample from ``logits`` (float32, written by the forward; its first V columns, the vocabulary)
        into ``sampled_ids``."""
        sampling = lambda name: self._sampling(step, name)  # noqa: E731
        self.kernels.sample(sampling("logits")[:, : self.vocab], sampling("temperature"), sampling("top_k"), sampling("top_p"),
                            sampling("seeds"),
                            sampling("sample_steps"), sampling("sampled_ids"), stream=step.stream)
