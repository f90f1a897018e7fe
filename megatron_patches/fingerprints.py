"""Fingerprints of the Megatron functions in patches.PATCHES, per Megatron-Core release.

{release: {target: (signature, hash of the normalized source, or None where the patch relies
on the signature only)}}. Written by `python -m megatron_patches.patches --record` on the
release installed, after the megatron tests pass on it; never edited by hand.
"""

RECORDED = {
    '0.19.1': {
        'megatron.core.datasets.utils:compile_helpers': (
            '()',
            None,
        ),
        'megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32': (
            '(parameters, max_norm, total_norm, use_decoupled_grad=False)',
            None,
        ),
        'megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__': (
            '(self, optimizer, config, grad_scaler, init_state_fn, model_chunks, per_model_buffers,'
            ' data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx,'
            ' distributed_optimizer_instance_id)',
            None,
        ),
        'megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__': (
            '(self, optimizer, config, grad_scaler, init_state_fn)',
            None,
        ),
        'megatron.core.optimizer.optimizer:MegatronOptimizer.step': (
            '(self)',
            None,
        ),
        'megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32': (
            '(parameters, max_norm, total_norm, use_decoupled_grad=False)',
            None,
        ),
        'megatron.core.tensor_parallel.random:initialize_rng_tracker': (
            '(use_te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False,'
            ' force_reset=False)',
            '8ffbb5624511c5b4',
        ),
        'megatron.core.transformer.moe.experts:TEGroupedMLP.forward': (
            '(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, output_buffer=None,'
            ' grad_input_buffer=None)',
            'db8242c4b9a2a880',
        ),
        'megatron.core.transformer.moe.moe_layer:MoELayer.__init__': (
            '(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,'
            ' name=None)',
            '7209ccedbf70713d',
        ),
        'megatron.core.transformer.moe.moe_layer:MoELayer.sharded_state_dict': (
            "(self, prefix='', sharded_offsets=(), metadata=None)",
            'eaa410dbb4744eff',
        ),
        'megatron.core.transformer.moe.token_dispatcher:_HybridEPManager': (
            '(group, num_local_experts, num_experts, config)',
            'd553f4676fcf29f7',
        ),
        'megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu': (
            '(tensor, as_numpy=False, record_stream=False)',
            None,
        ),
        'megatron.core.transformer.transformer_config:TransformerConfig.__post_init__': (
            '(self)',
            '2377af8b8e0184ed',
        ),
        'megatron.core.transformer.transformer_layer:TransformerLayer.__init__': (
            '(self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None,'
            ' vp_stage=None, is_mtp_layer=False, add_layer_offset=True, pp_layer_offset=None, name=None)',
            '38e6d6c471b31b0e',
        ),
        'megatron.training.arguments:add_megatron_arguments': (
            '(parser)',
            None,
        ),
        'megatron.training.initialize:_warmup_jit_function': (
            '(tp_size=None)',
            None,
        ),
        'megatron.training.training:calc_params_l2_norm': (
            '(model, force_create_fp32_copy=False)',
            '7bf7e7f836489af3',
        ),
        'megatron.training.training:save_checkpoint': (
            '(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,'
            ' checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,'
            ' pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,'
            ' train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, tp_group=None,'
            " pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix='')",
            None,
        ),
        'megatron.training.training:setup_model_and_optimizer': (
            '(model_type, model_provider_func=None, checkpointing_context=None, *, cfg_container=None,'
            ' pg_collection=None)',
            None,
        ),
    },
    '0.19.2': {
        'megatron.core.datasets.utils:compile_helpers': (
            '()',
            None,
        ),
        'megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32': (
            '(parameters, max_norm, total_norm, use_decoupled_grad=False)',
            None,
        ),
        'megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__': (
            '(self, optimizer, config, grad_scaler, init_state_fn, model_chunks, per_model_buffers,'
            ' data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx,'
            ' distributed_optimizer_instance_id)',
            None,
        ),
        'megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__': (
            '(self, optimizer, config, grad_scaler, init_state_fn)',
            None,
        ),
        'megatron.core.optimizer.optimizer:MegatronOptimizer.step': (
            '(self)',
            None,
        ),
        'megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32': (
            '(parameters, max_norm, total_norm, use_decoupled_grad=False)',
            None,
        ),
        'megatron.core.tensor_parallel.random:initialize_rng_tracker': (
            '(use_te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False,'
            ' force_reset=False)',
            '8ffbb5624511c5b4',
        ),
        'megatron.core.transformer.moe.experts:TEGroupedMLP.forward': (
            '(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, output_buffer=None,'
            ' grad_input_buffer=None)',
            'db8242c4b9a2a880',
        ),
        'megatron.core.transformer.moe.moe_layer:MoELayer.__init__': (
            '(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,'
            ' name=None)',
            '7209ccedbf70713d',
        ),
        'megatron.core.transformer.moe.moe_layer:MoELayer.sharded_state_dict': (
            "(self, prefix='', sharded_offsets=(), metadata=None)",
            'eaa410dbb4744eff',
        ),
        'megatron.core.transformer.moe.token_dispatcher:_HybridEPManager': (
            '(group, num_local_experts, num_experts, config)',
            'd553f4676fcf29f7',
        ),
        'megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu': (
            '(tensor, as_numpy=False, record_stream=False)',
            None,
        ),
        'megatron.core.transformer.transformer_config:TransformerConfig.__post_init__': (
            '(self)',
            '2377af8b8e0184ed',
        ),
        'megatron.core.transformer.transformer_layer:TransformerLayer.__init__': (
            '(self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None,'
            ' vp_stage=None, is_mtp_layer=False, add_layer_offset=True, pp_layer_offset=None, name=None)',
            '38e6d6c471b31b0e',
        ),
        'megatron.training.arguments:add_megatron_arguments': (
            '(parser)',
            None,
        ),
        'megatron.training.initialize:_warmup_jit_function': (
            '(tp_size=None)',
            None,
        ),
        'megatron.training.training:calc_params_l2_norm': (
            '(model, force_create_fp32_copy=False)',
            '7bf7e7f836489af3',
        ),
        'megatron.training.training:save_checkpoint': (
            '(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,'
            ' checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,'
            ' pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,'
            ' train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, tp_group=None,'
            " pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix='')",
            None,
        ),
        'megatron.training.training:setup_model_and_optimizer': (
            '(model_type, model_provider_func=None, checkpointing_context=None, *, cfg_container=None,'
            ' pg_collection=None)',
            None,
        ),
    },
    '0.20.0': {
        'megatron.core.datasets.utils:compile_helpers': (
            '()',
            None,
        ),
        'megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32': (
            '(parameters, max_norm, total_norm, use_decoupled_grad=False)',
            None,
        ),
        'megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__': (
            '(self, optimizer, config, grad_scaler, init_state_fn, model_chunks, per_model_buffers,'
            ' data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx,'
            ' distributed_optimizer_instance_id)',
            None,
        ),
        'megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__': (
            '(self, optimizer, config, grad_scaler, init_state_fn)',
            None,
        ),
        'megatron.core.optimizer.optimizer:MegatronOptimizer.step': (
            '(self)',
            None,
        ),
        'megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32': (
            '(parameters, max_norm, total_norm, use_decoupled_grad=False)',
            None,
        ),
        'megatron.core.tensor_parallel.random:initialize_rng_tracker': (
            '(use_te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False,'
            ' force_reset=False)',
            '8ffbb5624511c5b4',
        ),
        'megatron.core.transformer.moe.experts:TEGroupedMLP.forward': (
            '(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, output_buffer=None,'
            ' grad_input_buffer=None)',
            'b4efc5ab3f1f2318',
        ),
        'megatron.core.transformer.moe.moe_layer:MoELayer.__init__': (
            '(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,'
            ' name=None)',
            'd45746176932c7ec',
        ),
        'megatron.core.transformer.moe.moe_layer:MoELayer.sharded_state_dict': (
            "(self, prefix='', sharded_offsets=(), metadata=None)",
            'eaa410dbb4744eff',
        ),
        'megatron.core.transformer.moe.token_dispatcher:_HybridEPManager': (
            '(group, num_local_experts, num_experts, config)',
            'f758ca1defba3fc4',
        ),
        'megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu': (
            '(tensor, as_numpy=False, record_stream=False)',
            None,
        ),
        'megatron.core.transformer.transformer_config:TransformerConfig.__post_init__': (
            '(self)',
            'e516a104a95848b0',
        ),
        'megatron.core.transformer.transformer_layer:TransformerLayer.__init__': (
            '(self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None,'
            ' vp_stage=None, is_mtp_layer=False, add_layer_offset=True, pp_layer_offset=None, name=None)',
            '8a00aa8fda847c59',
        ),
        'megatron.training.arguments:add_megatron_arguments': (
            '(parser)',
            None,
        ),
        'megatron.training.initialize:_warmup_jit_function': (
            '(tp_size=None)',
            None,
        ),
        'megatron.training.training:calc_params_l2_norm': (
            '(model, force_create_fp32_copy=False)',
            '7bf7e7f836489af3',
        ),
        'megatron.training.training:save_checkpoint': (
            '(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,'
            ' checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,'
            ' pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,'
            ' train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, tp_group=None,'
            " pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix='')",
            None,
        ),
        'megatron.training.training:setup_model_and_optimizer': (
            '(model_type, model_provider_func=None, checkpointing_context=None, *, cfg_container=None,'
            ' pg_collection=None)',
            None,
        ),
    },
}
