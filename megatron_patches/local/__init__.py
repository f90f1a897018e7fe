"""Megatron-Core on one machine without a GPU: the CPU trainer, the demo, the CPU stand-ins.

    python -m megatron_patches.local.demo            # tiny MoE GPT, hybrid_ep against alltoall
    python -m megatron_patches.local.cpu_train ...   # what `hybrid-ep-launch <recipe> --local` runs

`cpu_compat` (CPU stand-ins for the few CUDA-only calls of Megatron-Core; installed only when
asked for: `apply(cpu_compat=True)`, as `common.init_megatron` and `cpu_train` do, or
HYBRID_EP_CPU_COMPAT=1; with them `cpu_training`, those of Megatron-LM's training loop, so
that megatron.training's own `pretrain()` runs on gloo ranks), `demo` (trains a tiny MoE GPT
with each dispatcher and compares the loss curves; `demo_ranks`, what its ranks run),
`cpu_train` (the local-mode trainer of the recipe launcher, Megatron-LM's arguments),
`common` (what they share: quiet libraries, the counting batches and their seed, the fp32
config, Megatron's parallel state), `layer` (one MoELayer with seeded weights: the layer
benchmark's and the tests' case). The test harnesses
(tests/harness/megatron) import from here, never the other way.
"""
