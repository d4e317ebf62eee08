"""Train a VLM with Megatron-LM's `pretrain` and megatron-vlm-packing's forward step.

    torchrun --nproc-per-node 8 examples/pretrain_vlm_packed.py \
        --tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --bf16 \
        --num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 \
        --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 4 --global-batch-size 64 \
        --train-iters 100 --lr 1e-4 --tokenizer-type NullTokenizer --vocab-size 256 \
        --dataloader-type external --transformer-impl transformer_engine --position-embedding-type rope \
        --calculate-per-token-loss --eval-iters 0 --eval-interval 1000 --no-gradient-accumulation-fusion

(`--no-gradient-accumulation-fusion` unless Apex's CUDA extensions are installed;
`--calculate-per-token-loss` makes Megatron use the exact (loss_sum, num_tokens) normalisation.)
Run on one H100 with megatron-core 0.19.2 + TE 2.20.2: benchmarks/results/pretrain_example_h100.md.

`megatron.training` ships in the megatron-core wheel. This example uses the embedded synthetic
dataset and the tiny vision tower; swap `model_provider` and `datasets_provider` for your own
model and data (docs/qwen_vl_guide.md). Every rank reads the same deterministic iterator
(`datasets_provider.is_distributed = True`); pass `broadcast_from_tp_rank0=True` to
`make_forward_step` for the Megatron-LM convention where TP rank 0 reads and broadcasts.
"""

from __future__ import annotations

import inspect
import itertools

import torch

from megatron_vlm_packing import make_forward_step
from megatron_vlm_packing.data import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.models.packed_vlm import PackedVLM
from megatron_vlm_packing.models.vision import TinyVisionTower

DATA = SyntheticVLMConfig()


def model_provider(pre_process=True, post_process=True, config=None, **unused):
    """GPTModel (its own SP scatter off: PackedVLM scatters after merging images) + vision tower."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_vlm_packing.attention import layer_spec

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    language_model = GPTModel(
        config=config, transformer_layer_spec=layer_spec("auto"), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=False, position_embedding_type=args.position_embedding_type,
        scatter_embedding_sequence_parallel=False,
    )
    vision = TinyVisionTower(patch_features=DATA.patch_features, width=256, out_hidden=config.hidden_size)
    return PackedVLM(language_model, vision, image_token_id=DATA.image_token_id)


def datasets_provider(train_val_test_num_samples):
    """Infinite deterministic iterators of collated, right-padded micro-batches (external loader)."""
    from megatron.training import get_args

    args = get_args()

    def stream(seed):
        for step in itertools.count():
            yield collate(synthetic_samples(args.micro_batch_size, seed=seed + step, cfg=DATA))

    return stream(1), stream(10**6), stream(2 * 10**6)


datasets_provider.is_distributed = True  # every rank builds the same iterator

forward_step = make_forward_step(pack=True, label_style="hf")


def skip_rebuilding_shipped_dataset_helpers() -> None:
    """megatron.training runs `make` on the dataset helpers at start-up, but the megatron-core wheel
    ships them compiled and without a Makefile (exit 1). Skip the rebuild when they import."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    from megatron.core.datasets import utils

    utils.compile_helpers = lambda: None


def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    skip_rebuilding_shipped_dataset_helpers()

    if "cfg_container" in inspect.signature(pretrain).parameters:
        # megatron-core >= 0.19: the training loop takes a config container built from the args.
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_args, validate_args
        from megatron.training.global_vars import set_global_variables

        args = parse_args()
        validate_args(args)
        set_global_variables(args)
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
                 forward_step, model_provider=model_provider)
    else:
        pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults={"tokenizer_type": "NullTokenizer"})


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = True
    main()
