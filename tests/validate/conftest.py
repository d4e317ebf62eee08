"""A valid VLM pack (our `pack_batch`, mRoPE, images, CP=2) as validator keywords, to plant bugs in."""

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.rope import MRopeConfig
from megatron_vlm_packing.validate import SourceRows

DATA = SyntheticVLMConfig()
MROPE = MRopeConfig(family="qwen2_vl", spatial_merge_size=2, image_token_id=DATA.image_token_id,
                    video_token_id=9999, vision_start_token_id=DATA.vision_start_id)


def pack_fields(batch: dict, *, cp_size: int = 1, mrope=MROPE, **layout) -> dict:
    """Validator keywords for `batch` packed by our pack_batch (HF labels), with its source rows."""
    packed = pack_batch(batch, cp_size=cp_size, label_style="hf", mrope=mrope, image_token_id=DATA.image_token_id,
                        **layout)
    params = packed.packed_seq_params
    fields = dict(
        input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
        position_ids=packed.position_ids, padding_mask=packed.padding_mask,
        cu_seqlens=params.cu_seqlens_q, cu_seqlens_padded=params.cu_seqlens_q_padded, max_seqlen=params.max_seqlen_q,
        source=SourceRows(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          labels=batch["labels"], label_style="hf"),
        cp_size=cp_size, pad_token_id=0, **layout,
    )
    if mrope is not None and "image_grid_thw" in batch:
        fields.update(image_grid_thw=batch["image_grid_thw"], image_token_id=DATA.image_token_id,
                      spatial_merge_size=2, mrope=mrope)
    return fields


def vlm_batch(seed: int = 3, num: int = 5) -> dict:
    samples = synthetic_samples(num, seed=seed)
    return collate(samples)


@pytest.fixture(scope="session")
def vlm_pack():
    """(batch, fields): 5 samples with images, CP=2; at least two documents hold images."""
    batch = vlm_batch()
    fields = pack_fields(batch, cp_size=2)
    images = (batch["input_ids"] == DATA.image_token_id).any(dim=1)
    assert int(images.sum()) >= 2 and len(batch["image_grid_thw"]) >= 3
    return batch, fields


def clone(fields: dict, **changes) -> dict:
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    out.update(changes)
    return out
