"""Memory per GPU of a pretraining recipe: weights, gradients, optimizer state, activations.

Parameters are counted from the recipe's model shape, per pipeline stage (the stage with
the most bytes is reported, since that one runs out first):

    attention   MHA/GQA: H*(a*d) + 2*H*(g*d) + (a*d)*H          (a heads, g query groups, d head dim)
                MLA:     H*q + q*a*(dn+dr) + H*(c+dr) + c*a*(dn+dv) + a*dv*H + q + c
                         (q = q_lora_rank, or no down-projection when null; c = kv_lora_rank)
    norms       2*H per layer, H for the final norm
    dense MLP   m*H*F                                      (m = 3 with SwiGLU, else 2)
    MoE layer   E*H (router) + E*m*H*Fe (experts) + m*H*Fs (shared expert)
    embedding   V*H on the first stage; the output layer V*H on the last (untied)

Sharding: dense parameters (everything but the routed experts) / TP; routed experts: the
stage's MoE layers x E/EP experts x (m*H*Fe) / ETP, with `balancer.slots_per_rank` slots in
place of E/EP when the balancer is on (spare slots hold replicas: real memory, reported
on their own as `spare_slots_gb`: the spare slots' weights, fp32 main grads, fp32 master
weights and Adam moments, the last two / EDP with the distributed optimizer, which shards
them as it shards every expert's; printed after the total, as a part of the rows above, and
with `max_spare_slots_gb` of `max_spare_stage` where another stage, with more MoE layers,
pays more for them). Bytes per parameter:

    weights     2 (bf16 / fp16 / fp8 runs keep bf16 weights), 4 for fp32
    gradients   4 (Megatron's fp32 main-grad buffer), 2 for fp16 (its grads stay fp16
                unless --accumulate-allreduce-grads-in-fp32, which bf16 and fp8 runs turn on)
    optimizer   12 = fp32 master copy 4 + Adam moments 8 (8 for fp32: no separate master)
                divided by DP x CP (dense) or EDP (experts) with the distributed optimizer

Activations are a rough estimate, reported separately and included in the total: per
micro-batch and layer, t = seq x micro_batch / CP tokens, 2 bytes per value (sequence
parallel: / TP), values kept per token:

    attention side  10*H/TP (norm in/out, QKV, context, projection, residual); 8*H/TP when
                    `layernorm` is recomputed
    MoE MLP         k*(H + 3*Fe)/ETP: dispatched rows (fc1 input), fc1 output (SwiGLU's two
                    halves), activation output; k*(H + 2*Fe) with `moe_act` recomputed;
                    H/TP with `moe` recomputed
    dense MLP       (H + 3*F)/TP; H/TP with `mlp` recomputed
    full recompute  H/TP per layer (its input) plus one layer's full set

Stage s holds min(PP - s, micro-batches per step) micro-batches in flight (1F1B; interleaved
VPP adds more and is not modelled). Balanced routing assumed.

The dispatcher: with hybrid_ep, the bytes its buffer holds for the job's life (registered,
by region), from the library's memory_plan() for the recipe's shape, backend and EP layout
(dispatcher_memory.py), on every stage with MoE layers, in the total. Where the backend that
runs holds nothing (reference: its buffers come from the allocator per call, and the
dispatch outputs are in the activations above), the table says what the cuda backend would
hold, outside the total. Allocator fragmentation, NCCL's buffers and the CUDA context are
not counted: leave 5-10 GiB of headroom.
"""

from __future__ import annotations

import dataclasses

from .dispatcher_memory import DispatcherMemory, dispatcher_memory
from .shape import shape_of, stage_layers

GIB = 1024**3

# Memory per GPU in GiB (nominal HBM).
GPU_MEMORY_GB = {"A100": 80, "H100": 80, "H200": 141, "B200": 180, "GB200": 186, "B300": 288,
                 "GB300": 288, "CPU": 10**6}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    stage: int
    dense_params: float        # per GPU (after TP)
    expert_params: float       # per GPU (after EP x ETP)
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    gpu_gb: float
    total_params_model: float  # whole model, for the record
    spare_slots_gb: float = 0.0  # part of the states above: the balancer's spare expert slots
    grads_dtype: str = "fp32"
    # the stage whose spare slots cost the most (stages differ in MoE layers) and that cost
    max_spare_stage: int = 0
    max_spare_slots_gb: float = 0.0
    # the hybrid_ep dispatcher's buffer (None: another dispatcher), held on stages with MoE layers
    dispatcher: DispatcherMemory | None = None
    dispatcher_gb: float = 0.0
    # what the cuda backend would hold where the backend that runs holds nothing (not in the total)
    cuda_dispatcher: DispatcherMemory | None = None

    @property
    def states_gb(self) -> float:
        return self.weights_gb + self.grads_gb + self.optimizer_gb

    @property
    def total_gb(self) -> float:
        return self.states_gb + self.activations_gb + self.dispatcher_gb

    @property
    def over(self) -> bool:
        return self.total_gb > self.gpu_gb

    def size(self, gib: float) -> str:
        """A row's amount in the table's unit: GiB, or MiB for a model whose total is below
        1 GiB (tiny_moe's rows all read 0.0 GiB)."""
        if self.total_gb >= 1:
            return f"{gib:7.1f} GiB"
        return f"{gib * 1024:7.1f} MiB"

    def table(self, on_cpu: bool = False) -> str:
        """on_cpu: ranks are CPU processes (local mode): per rank, no GPU memory to compare with."""
        total = self.size(self.total_gb) + ("" if on_cpu else f" of {self.gpu_gb:g} GiB")
        rows = [
            (f"parameters / {'rank' if on_cpu else 'GPU'}",
             f"{_count(self.dense_params)} dense + {_count(self.expert_params)} experts"),
            ("weights", self.size(self.weights_gb)),
            (f"gradients ({self.grads_dtype})", self.size(self.grads_gb)),
            ("optimizer (fp32 master + Adam)", self.size(self.optimizer_gb)),
            ("activations (rough)", self.size(self.activations_gb)),
            *self._dispatcher_rows(),
            ("total", total),
        ]
        head = (f"memory per {'rank (CPU process)' if on_cpu else 'GPU'}, stage {self.stage} (the fullest "
                "pipeline stage; model "
                f"{_count(self.total_params_model)} parameters):")
        return "\n".join([head] + _aligned(rows) + _aligned(self._spare_rows() + ([] if on_cpu else self._cuda_rows())))

    def _dispatcher_rows(self) -> list[tuple[str, str]]:
        """The hybrid_ep buffer's held bytes, then each held region below it."""
        d = self.dispatcher
        if d is None:
            return []
        label = f"dispatcher buffer (hybrid_ep {d.backend})"
        if not self.dispatcher_gb:
            why = "no MoE layer on this stage" if d.held_bytes else f"{d.why}: per-call buffers from the allocator"
            return [(label, f"{self.size(0.0)}  ({why})")]
        return [(label, f"{self.size(self.dispatcher_gb)}  ({d.why})")] + [
            (f"  {name}", self.size(n / GIB) if n >= GIB / 10 or self.total_gb < 1 else f"{n / 2**20:7.1f} MiB")
            for name, n in d.regions()]

    def _cuda_rows(self) -> list[tuple[str, str]]:
        """What opting into the cuda backend would add (dispatcher.backend cuda), outside the total."""
        d = self.cuda_dispatcher
        if d is None:
            return []
        label = "with dispatcher.backend cuda the buffer would hold (not in the total)"
        return [(label, self.size(d.held_bytes / GIB))]

    def _spare_rows(self) -> list[tuple[str, str]]:
        """The spare slots after the total, as a part of it (not an extra row of the optimizer's),
        and the stage paying the most for them: the fullest stage may hold the fewest MoE layers."""
        if not self.max_spare_slots_gb:  # balancer off (or a model without MoE layers)
            return []
        rows = [("balancer spare slots (weights + grads + optimizer, in the rows above)",
                 self.size(self.spare_slots_gb))]
        if self.max_spare_stage != self.stage:
            rows.append((f"balancer spare slots on stage {self.max_spare_stage} (the most of any stage)",
                         self.size(self.max_spare_slots_gb)))
        return rows


def _aligned(rows: list[tuple[str, str]]) -> list[str]:
    width = max((len(r[0]) for r in rows), default=0)
    return [f"  {k:<{width}}  {v}" for k, v in rows]


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _attention_params(m) -> float:
    H, a = m["hidden_size"], m["num_attention_heads"]
    if m["mla"]["enabled"]:
        mla = m["mla"]
        q, c = mla["q_lora_rank"], mla["kv_lora_rank"]
        dn, dr, dv = mla["qk_head_dim"], mla["qk_pos_emb_head_dim"], mla["v_head_dim"]
        q_proj = (H * q + q + q * a * (dn + dr)) if q else H * a * (dn + dr)
        return q_proj + H * (c + dr) + c + c * a * (dn + dv) + a * dv * H
    d = m["kv_channels"] or H // a
    g = m["num_query_groups"] or a
    return H * a * d + 2 * H * g * d + a * d * H


def _mult(m) -> int:
    return 3 if m["swiglu"] else 2


def layer_params(m, moe: bool) -> tuple[float, float]:
    """(dense, routed-expert) parameters of one transformer layer, unsharded."""
    H = m["hidden_size"]
    dense = _attention_params(m) + 2 * H
    if not moe:
        return dense + _mult(m) * H * m["ffn_hidden_size"], 0.0
    E = m["num_experts"]
    dense += E * H + _mult(m) * H * (m["moe_shared_expert_intermediate_size"] or 0)
    return dense, E * _mult(m) * H * m["moe_ffn_hidden_size"]


def model_params(recipe) -> float:
    m = recipe["model"]
    total = m["vocab_size"] * m["hidden_size"] * (2 if m["untie_embeddings"] else 1) + m["hidden_size"]
    dense = min(max(m["dense_layers"], 0), m["num_layers"])  # every layer of a kind has the same count
    total += dense * sum(layer_params(m, moe=False)) + (m["num_layers"] - dense) * sum(layer_params(m, moe=True))
    return total


def _activation_bytes(recipe, shape, stage: int, dense_layers: int, moe_layers: int) -> float:
    m, t_cfg = recipe["model"], recipe["train"]
    H, k, Fe, F = m["hidden_size"], m["moe_router_topk"], m["moe_ffn_hidden_size"], m["ffn_hidden_size"]
    tokens = m["seq_length"] * t_cfg["micro_batch_size"] / shape.cp
    mods = set(t_cfg["recompute_modules"]) if t_cfg["recompute"] == "selective" else set()
    attention = (8 if "layernorm" in mods else 10) * H / shape.tp
    dense_mlp = (H if "mlp" in mods else H + 3 * F) / shape.tp
    if "moe" in mods:
        moe_mlp = H / shape.tp
    else:
        moe_mlp = k * (H + (2 if "moe_act" in mods else 3) * Fe) / shape.etp
    per_dense, per_moe = attention + dense_mlp, attention + moe_mlp
    micro_batches = max(1, t_cfg["global_batch_size"] // max(1, t_cfg["micro_batch_size"] * shape.dp))
    in_flight = min(shape.pp - stage, micro_batches)  # 1F1B: stage s holds PP - s micro-batches
    if t_cfg["recompute"] == "full":
        kept = (dense_layers + moe_layers) * H / shape.tp * in_flight  # layer inputs only
        return 2 * tokens * (kept + max(per_dense if dense_layers else 0, per_moe if moe_layers else 0))
    return 2 * tokens * (dense_layers * per_dense + moe_layers * per_moe) * in_flight


def grad_bytes(precision: str) -> int:
    """Bytes of Megatron's main-grad buffer per parameter: fp32 (accumulated and all-reduced
    in fp32, which Megatron-LM turns on for bf16), fp16 runs keep fp16 grads by default."""
    return 2 if precision == "fp16" else 4


def estimate(recipe) -> MemoryEstimate:
    """The fullest stage's bytes per GPU (see the module docstring for the formula)."""
    return _fullest(stage_estimates(recipe))


def stage_estimates(recipe) -> list[MemoryEstimate]:
    """Bytes per GPU of each pipeline stage."""
    m, shape = recipe["model"], shape_of(recipe)
    stages = stage_layers(recipe)
    weight_b = 4 if recipe["precision"] == "fp32" else 2
    grad_b = grad_bytes(recipe["precision"])
    opt_b = 8 if recipe["precision"] == "fp32" else 12
    dist_opt = recipe["parallelism.distributed_optimizer"]
    slots = recipe["balancer.slots_per_rank"] if recipe["balancer.interval"] > 0 else None
    disp = dispatcher_memory(recipe)
    cuda = dispatcher_memory(recipe, "cuda") if disp is not None and not disp.held_bytes else None
    experts_per_rank = slots or m["num_experts"] // shape.ep
    per_stage, start = [], 0
    for s, n in enumerate(stages):
        n_dense = min(max(m["dense_layers"] - start, 0), n)  # layers start .. start + n - 1 below dense_layers
        start += n
        n_moe = n - n_dense
        dense = n_dense * layer_params(m, False)[0] + n_moe * layer_params(m, True)[0]
        experts_full = n_moe * layer_params(m, True)[1]
        if s == 0:
            dense += m["vocab_size"] * m["hidden_size"]
        if s == len(stages) - 1:
            dense += m["hidden_size"] + (m["vocab_size"] * m["hidden_size"] if m["untie_embeddings"] else 0)
        dense /= shape.tp
        experts = experts_full / m["num_experts"] * experts_per_rank / shape.etp
        spare = experts_full / m["num_experts"] * (experts_per_rank - m["num_experts"] // shape.ep) / shape.etp
        opt_dense = dense * opt_b / (shape.dp * shape.cp if dist_opt else 1)
        opt_exp = experts * opt_b / (shape.edp if dist_opt else 1)
        act = _activation_bytes(recipe, shape, s, n_dense, n_moe)
        per_stage.append(MemoryEstimate(
            stage=s, dense_params=dense, expert_params=experts,
            weights_gb=(dense + experts) * weight_b / GIB, grads_gb=(dense + experts) * grad_b / GIB,
            optimizer_gb=(opt_dense + opt_exp) / GIB, activations_gb=act / GIB,
            gpu_gb=GPU_MEMORY_GB.get(recipe["cluster.gpu_type"], 0), total_params_model=model_params(recipe),
            grads_dtype="fp16" if grad_b == 2 else "fp32",
            spare_slots_gb=spare * (weight_b + grad_b + opt_b / (shape.edp if dist_opt else 1)) / GIB,
            dispatcher=disp, dispatcher_gb=disp.held_bytes / GIB if disp is not None and n_moe else 0.0,
            cuda_dispatcher=cuda))
    return per_stage


def _fullest(per_stage: list[MemoryEstimate]) -> MemoryEstimate:
    """The stage with the largest total (the first of equals), told which stage's spare slots
    cost the most: that one, where it ties with the most, else the first with the most."""
    best = max(per_stage, key=lambda e: e.total_gb)
    most = max(e.spare_slots_gb for e in per_stage)
    stage = best.stage if best.spare_slots_gb == most else next(e.stage for e in per_stage
                                                                if e.spare_slots_gb == most)
    return dataclasses.replace(best, max_spare_stage=stage, max_spare_slots_gb=most)
