"""Shaped like Megatron-LM's pretrain_gpt.py (Megatron-Core 0.19's), for the launcher's tests.

Its `__main__` is the real script's: the entry wrapped by
`inprocess_restart.maybe_wrap_for_inprocess_restart` (which parses the command line itself,
with no provider), `parse_and_validate_args` with an extra_args_provider of its own, the
model and training configs from the arguments, and megatron.training's own `pretrain()`.
Batches come from megatron.core's MockGPTDataset; the loss is the real script's without
ModelOpt, distillation or the rerun checks. The folder has no `megatron` package, so the
launcher runs it on the installed megatron-core (tests/megatron/test_launcher_pretrain.py).
"""

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, inprocess_restart, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def own_arguments(parser):
    """The script's own provider (the real one passes ModelOpt's, or none)."""
    parser.add_argument("--shaped-script-flag", type=int, default=0)
    return parser


def get_batch(data_iterator):
    batch = next(data_iterator)
    return [batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None for key in BATCH_KEYS]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, split=args.split,
        tokenizer=build_tokenizer(args), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True

    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    args = parse_and_validate_args(extra_args_provider=own_arguments,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    print_rank_0(f"> shaped script flag {args.shaped_script_flag}")
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             store=store)
