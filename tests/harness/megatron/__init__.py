"""What the Megatron tests run on each rank of their process pools: one MoE layer against its
dense reference, the dispatcher contracts, the EP-overlap schedule, balancer training runs and
checkpoints, and Transformer Engine stood in. They build on the local demo
(megatron_patches.local), never the other way."""
