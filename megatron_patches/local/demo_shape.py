"""The demo's model shape and the byte fields of its step records, shared by the demo (which
must not load torch before its arguments are checked) and what its ranks run (demo_ranks)."""

LAYERS, HIDDEN, HEADS, EXPERTS, TOPK, VOCAB = 2, 128, 4, 8, 2, 256
BYTE_FIELDS = ("nvlink_bytes", "rdma_bytes", "flat_nvlink_bytes", "flat_rdma_bytes")
