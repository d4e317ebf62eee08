"""mRoPE under packing: a tiny mrope GPTModel, packed with per-sample 3D positions, vs each sample alone.

`run_mrope_parity(rank, world_size, cp_sizes)` is a `run_distributed` target. For every CP size it
returns the worst |dloss| between the packed run (the shipped `make_forward_step`, the batch's
[3, B, S] positions packed per document) and
each sample alone with its own `get_rope_index` positions, plus the same with 1D positions
broadcast to three channels (bug class 1, made on purpose by a transform: the step itself refuses
1D positions for an mRoPE model), which must differ, and the same with Megatron-Core's own
`MultimodalRotaryEmbedding` (which CP-slices the whole packed table: bug class 6; the GPTModel
adapter refuses it under CP, so this measurement uses an adapter without that refusal).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.models.gpt_adapter import GPTModelAdapter
from megatron_vlm_packing.packing.pack import segment_positions
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index, use_packed_mrope
from megatron_vlm_packing.step import make_forward_step
from megatron_vlm_packing.runtime.launcher import initialize_parallel
from megatron_vlm_packing.testing.parity import gather_cp_tokens

DATA = SyntheticVLMConfig(max_text=16, max_images=3, grid_choices=(2, 4, 6))
ROPE = MRopeConfig(family="qwen2_vl", image_token_id=DATA.image_token_id, video_token_id=DATA.image_token_id - 1,
                   vision_start_token_id=DATA.vision_start_id, mrope_section=(1, 1, 2))
LM = TinyGPTConfig(vocab_size=DATA.vocab_size, position_embedding_type="mrope", mrope_section=(1, 1, 2),
                   max_sequence_length=1024)


def alone_losses(model, batch) -> torch.Tensor:
    """Per-token losses of every sample alone, at targets (HF labels shifted inside the sample)."""
    out = []
    image_row = 0
    for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        ids = batch["input_ids"][row:row + 1, :n]
        blocks = int(((ids == ROPE.image_token_id) & (torch.roll(ids, 1, 1) != ROPE.image_token_id)).sum())
        grids = batch["image_grid_thw"][image_row:image_row + blocks]
        image_row += blocks
        pos = get_rope_index(ids, ROPE, image_grid_thw=grids if blocks else None).position_ids  # [3, 1, n]
        labels = torch.cat([batch["labels"][row:row + 1, 1:n], torch.full((1, 1), -100)], dim=1)
        loss = model(ids, pos, None, labels=labels.clamp_min(0))
        out.append(loss[0][labels[0] != -100])
    return torch.cat(out)


class MegatronRotaryAdapter(GPTModelAdapter):
    """GPTModelAdapter without its refusal of Megatron-Core's own mRoPE rotary under CP, to measure bug class 6."""

    def refuse_megatron_mrope_under_cp(self, model) -> None:
        return None


def broadcast_1d_positions(mb):
    """Bug class 1 made on purpose: each document's 1D positions copied to the 3 mRoPE channels."""
    return replace(mb, position_ids=segment_positions(mb.indices).expand(3, 1, -1))


def packed_losses(model, batch, cp_size: int, *, broadcast_1d: bool, adapter=None) -> torch.Tensor:
    """Per-token losses at targets of the packed batch through the shipped step, gathered over CP."""
    from megatron.core import parallel_state as ps

    seen = []

    def observe(mb):
        mb = broadcast_1d_positions(mb) if broadcast_1d else mb
        seen.append(mb)
        return mb

    # A text GPTModel has no tower: the collator's [3, B, S] positions (each row's own get_rope_index)
    # carry the images' t/h/w, and the step packs them per document.
    positions = get_rope_index(batch["input_ids"], ROPE, image_grid_thw=batch["image_grid_thw"],
                               attention_mask=batch["attention_mask"]).position_ids
    text_only = {k: batch[k] for k in ("input_ids", "labels", "attention_mask")} | {"position_ids": positions}
    step = make_forward_step(transform=observe, adapter=adapter)
    loss, _ = step(iter([text_only]), model)  # [1, T/cp]
    cu_padded = seen[0].packed_seq_params.cu_seqlens_q_padded
    full = gather_cp_tokens(loss.detach(), cu_padded, ps.get_context_parallel_group())[0]
    return full[seen[0].loss_mask[0].bool()]


def run_mrope_parity(rank: int, world_size: int, cp_sizes: list[int], seed: int = 3):
    batch = collate(synthetic_samples(5, seed=seed, cfg=DATA))
    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    reference = build_tiny_gpt(LM)
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    with torch.no_grad():
        alone = alone_losses(reference, batch)
    results = []
    for cp in cp_sizes:
        initialize_parallel(cp=cp, seed=seed)
        row = dict(cp=cp, image_tokens=int((batch["input_ids"] == ROPE.image_token_id).sum()))
        for ours in (True, False):
            model = build_tiny_gpt(replace(LM, context_parallel=cp))
            if ours:
                use_packed_mrope(model)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(state[name])
                adapter = None if ours else MegatronRotaryAdapter
                first = packed_losses(model, batch, cp, broadcast_1d=False, adapter=adapter)
                errors = [(first - alone).abs().max().item()]
                if ours:
                    wrong = packed_losses(model, batch, cp, broadcast_1d=True)
                    errors.append((wrong - alone).abs().max().item())
                    # packed, then dense, then packed: no state leaks between calls (bug class 5)
                    dense = alone_losses(model, batch) if cp == 1 else alone
                    again = packed_losses(model, batch, cp, broadcast_1d=False)
                    errors += [(dense - alone).abs().max().item(), (again - first).abs().max().item()]
            worst = torch.tensor(errors)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if ours:
                row.update(max_dloss=worst[0].item(), max_dloss_1d_broadcast=worst[1].item(),
                           dense_after_packed=worst[2].item(), packed_again=worst[3].item())
            else:
                row.update(max_dloss_megatron_rotary=worst[0].item())
        results.append(row)
    return results
