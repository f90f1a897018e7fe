"""Test harnesses of the Megatron integration: what runs on every rank of a test's process pool.

They live in a package so that the pool's spawned workers can import them (hybrid_ep.spawn
sends functions by module and name). Used by tests/megatron/; no production module imports them.

`moe_layer` (one MoELayer on W ranks, and the same layer computed densely), `contracts`
(Megatron's dispatcher contracts per rank), `overlap` (one training step of a tiny GPT through
Megatron's schedules), `balancer_runs` (training runs with and without the expert balancer),
`balancer_checkpoints` (checkpoint round trips of a balanced layer), `balancer_common` (what
the two balancer harnesses share). The seeded layer case, Megatron's parallel state and the fp32
config come from megatron_patches.local.
"""
