"""The planner tests' synthetic VLM samples and the metadata a loader knows of them before reading pixels."""

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig
from megatron_vlm_packing.planner import SampleMetadata

CFG = SyntheticVLMConfig(max_text=40, grid_choices=(2, 4))


def metadata(sample: dict) -> SampleMetadata:
    """What a loader knows before reading pixels: token ids and image grids."""
    grids = tuple(tuple(int(x) for x in g) for g in sample["image_grid_thw"].tolist())
    vision = sum(t * h * w // 4 + 2 for t, h, w in grids)
    return SampleMetadata(text_tokens=len(sample["input_ids"]) - vision, image_grids=grids)
