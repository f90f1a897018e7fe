"""Every Megatron function megatron_patches replaces, why, and the releases each was checked on.

hybrid_ep runs as a backend of Megatron-Core's flex token dispatcher (megatron_patches.manager,
megatron_patches.selection), so Megatron's own code answers for it in validation, the
EP-overlap schedule and the experts' padding; what has no extension point (the name the flex
dispatcher builds its backend by, validation of the name, the grouped experts, Megatron-LM's
training loop) the integration wraps. A wrapper that silently
stops matching a new release is how such an integration breaks, so each one is listed here,
once: `apply()` installs the ones marked `apply()` by walking PATCHES, docs/megatron.md's
patch table is `markdown_table()` (a test compares the two), and each target's signature,
and where the wrapper depends on the function's body a hash of its source, is recorded per
tested Megatron-Core release in `fingerprints.py`; `check()` compares them with the
installed Megatron-Core and names every function that changed (tests/megatron/test_patches.py).

    python -m megatron_patches.patches            # the table docs/megatron.md carries
    python -m megatron_patches.patches --check    # the installed Megatron-Core against the record
    python -m megatron_patches.patches --record   # record it (after the megatron tests pass on it)

Targets are "module:qualified name", the module being the one whose binding is replaced
(`experts:skip_routed_expert_padding`, not moe_utils where it is defined).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import logging
import sys
import textwrap
import tokenize

APPLY = "`apply()`"
LAUNCHER = "the launcher"
CPU_COMPAT = "`cpu_compat`"

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced Megatron function.

    target: "module:qualname" of the binding replaced. replacement: the module of this package
    holding the wrapper. does: what changes. reason: why no Megatron extension point serves.
    installed_by: APPLY (installed by `installer`, a function of this package, "module:name",
    whose result apply() returns under `key`), LAUNCHER (python -m megatron_patches.pretrain_gpt,
    while pretrain_gpt.py runs), CPU_COMPAT (only when the CPU stand-ins are asked for), or
    the patch that installs it on each object it builds. body: the wrapper relies on what the
    function does inside, not only on its signature, so its source is fingerprinted too; that of
    `body_of` where what it relies on is another function's (a replaced name: its caller).
    """

    target: str
    replacement: str
    does: str
    reason: str
    installed_by: str = APPLY
    installer: str | None = None
    key: str | None = None
    body: bool = False
    body_of: str | None = None

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":")[1]


_MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
_TRAINING = "megatron.training.training"

PATCHES = (
    Patch(
        target=f"{_MOE_LAYER}:MoELayer.__init__",
        replacement="selection.py",
        does="type `hybrid_ep`: turns the config into the flex dispatcher with hybrid_ep's `hybridep` backend, "
             "runs the original with `_HybridEPManager` bound to `HybridEPManager` (next row), then gives the "
             "manager the experts built; every type: experts built under generators of their own "
             "(`expert_init.py`), balancer slots",
        reason="the layer's config must say `flex` before Megatron reads it at run time; the experts are built "
               "after the dispatcher, and MoELayer has no hook between",
        installer="selection:patch_moe_layer", key="moe_layer", body=True,
    ),
    Patch(
        target="megatron.core.transformer.moe.token_dispatcher:_HybridEPManager",
        replacement="manager.py",
        does="while the `MoELayer.__init__` patch builds a hybrid_ep layer: the flex dispatcher's `hybridep` "
             "backend is `HybridEPManager` (the same constructor keywords), not DeepEP's",
        reason="`MoEFlexTokenDispatcher` builds its manager with a fixed if/elif on the backend name "
               "(deepep, hybridep, ncclep) and validation accepts no other; Megatron-Core has no backend registry",
        installed_by="the `MoELayer.__init__` patch, while it builds a hybrid_ep layer", body=True,
        body_of="megatron.core.transformer.moe.token_dispatcher:MoEFlexTokenDispatcher",
    ),
    Patch(
        target="megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
        replacement="selection.py",
        does="type `hybrid_ep`: validates as `flex` with backend `hybridep` and `moe_expert_rank_capacity_factor` "
             "hidden (all restored after); refuses `moe_paged_stash`",
        reason="validation knows only its own type names, and asks for Transformer Engine's op fuser with the "
               "rank capacity factor and `hybridep`, which hybrid_ep does not need",
        installer="selection:patch_config_validation", key="config_validation", body=True,
    ),
    Patch(
        target="megatron.core.transformer.transformer_layer:TransformerLayer.__init__",
        replacement="expert_init.py",
        does="makes the layer being built visible to the MoE layer it builds (its global layer number "
             "seeds the experts)",
        reason="MoELayer gets its layer number only after its experts are built; no hook runs in between",
        installer="expert_init:install_layer_context", key="expert_init", body=True,
    ),
    Patch(
        target="megatron.core.transformer.moe.experts:TEGroupedMLP.forward",
        replacement="grouped_gemm.py",
        does="every type: empty groups get zero rows, rows past the last group come back as zeros, the "
             "expert linears run on every rank",
        reason="grouped GEMMs break on empty groups; the expert module has no hook around its GEMMs",
        installer="grouped_gemm:install", key="grouped_gemm", body=True,
    ),
    Patch(
        target=f"{_TRAINING}:setup_model_and_optimizer",
        replacement="balancer.py",
        does="with `--hybrid-ep-balancer-interval`: attaches the expert balancer to the model and optimizer "
             "it returns",
        reason="Megatron-LM's `pretrain()` builds both inside and calls no user code before training",
        installer="balancer:install_training_hook", key="balancer_hook",
    ),
    Patch(
        target=f"{_TRAINING}:save_checkpoint",
        replacement="balancer.py",
        does="with the balancer: its `prepare_checkpoint()` on every rank first",
        reason="no callback before Megatron-LM saves",
        installer="balancer:install_training_hook", key="balancer_hook",
    ),
    Patch(
        target=f"{_TRAINING}:calc_params_l2_norm",
        replacement="balancer.py",
        does="with the balancer: the norm over the model without replica slots",
        reason="`--log-params-norm` sums every parameter of the model chunks it is given",
        installer="balancer:install_training_hook", key="balancer_hook", body=True,
    ),
    Patch(
        target="megatron.core.optimizer.optimizer:MegatronOptimizer.step",
        replacement="balancer.py",
        does="the optimizer's own `step` (an attribute of the instance): replicas' gradients summed "
             "before, every K steps a rebalance after",
        reason="Megatron-LM's loop calls `optimizer.step()` with nothing around it",
        installed_by="`balancer.attach()`, on the optimizer",
    ),
    Patch(
        target=f"{_MOE_LAYER}:MoELayer.sharded_state_dict",
        replacement="balancer.py",
        does="the layer's own (an attribute of the instance): expert keys under `hybrid_ep_slot_experts.`, "
             "placement and statistics as objects",
        reason="the keys come from the expert modules' names; slot-built experts need keys of their own",
        installed_by="the `MoELayer.__init__` patch, on each layer built with the balancer", body=True,
    ),
    Patch(
        target="megatron.training.arguments:add_megatron_arguments",
        replacement="pretrain_gpt.py",
        does="every parser of Megatron-LM's arguments also gets `megatron_patches.extra_args_provider`'s choice "
             "and flags (before the caller's own provider runs)",
        reason="pretrain_gpt.py passes its own provider (ModelOpt's or none) and takes no other, and the in-process "
               "restart and fault-tolerance set-ups parse the command line with no provider; every parse builds "
               "its parser here",
        installed_by=LAUNCHER,
    ),
    Patch(
        target="megatron.core.tensor_parallel.random:initialize_rng_tracker",
        replacement="local/cpu_compat.py",
        does="keeps the CPU RNG tracker",
        reason="the tracker forks the CUDA generator",
        installed_by=CPU_COMPAT, body=True,
    ),
    Patch(
        target="megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        replacement="local/cpu_compat.py",
        does="host split lists for CPU tensors too",
        reason="the alltoall dispatcher makes host lists only of CUDA tensors",
        installed_by=CPU_COMPAT,
    ),
    Patch(
        target="megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
        replacement="local/cpu_compat.py",
        does="CPU tensors answer `type()` with CUDA names",
        reason="parameter kinds are told apart by CUDA type names",
        installed_by=CPU_COMPAT,
    ),
    Patch(
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
        replacement="local/cpu_compat.py",
        does="as above",
        reason="as above",
        installed_by=CPU_COMPAT,
    ),
    Patch(
        target="megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
        replacement="local/cpu_compat.py",
        does="as above",
        reason="as above",
        installed_by=CPU_COMPAT,
    ),
    Patch(
        target="megatron.training.initialize:_warmup_jit_function",
        replacement="local/cpu_training.py",
        does="nothing (Megatron-LM's training loop on the host)",
        reason="it compiles the fused bias-GeLU and bias-dropout-add for the GPU on `device=\"cuda\"` inputs",
        installed_by=CPU_COMPAT,
    ),
    Patch(
        target="megatron.core.datasets.utils:compile_helpers",
        replacement="local/cpu_training.py",
        does="nothing where the megatron-core wheel's built dataset helpers import and no Makefile is beside them",
        reason="`initialize_megatron` runs `make` in megatron/core/datasets, which the wheel ships built and "
               "without the Makefile",
        installed_by=CPU_COMPAT,
    ),
    Patch(
        target="megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
        replacement="local/cpu_compat.py",
        does="as above (the binding the optimizer calls)",
        reason="as above",
        installed_by=CPU_COMPAT,
    ),
)


def by_target() -> dict[str, Patch]:
    return {p.target: p for p in PATCHES}


# -- installing -------------------------------------------------------------------------------


def _installers() -> dict[str, object]:
    """The modules whose functions install the patches apply() makes (imported here, so that the
    import graph shows what apply() depends on)."""
    from . import balancer, expert_init, grouped_gemm, selection

    return {"balancer": balancer, "expert_init": expert_init, "grouped_gemm": grouped_gemm, "selection": selection}


def install() -> dict[str, object]:
    """Run each installer of an APPLY patch once, in table order: {key: what it returned}."""
    modules = _installers()
    done: dict[str, object] = {}
    for patch in PATCHES:
        if patch.installed_by != APPLY or patch.key in done:
            continue
        module, name = patch.installer.split(":")
        done[patch.key] = getattr(modules[module], name)()
    return done


# -- fingerprints -----------------------------------------------------------------------------


def resolve(target: str):
    """The object bound at `target` in the imported Megatron (AttributeError / ImportError when gone)."""
    import importlib

    module, qualname = target.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _original(obj):
    """Megatron's own function behind our wrappers (and behind its own functools.wraps decorators:
    the same function patched or not)."""
    return inspect.unwrap(obj)


def normalized_source(fn) -> str:
    """The function's tokens without comments and layout (a reformatted or re-commented function
    keeps its hash; any change to the code, strings or block structure changes it)."""
    source = textwrap.dedent(inspect.getsource(fn))
    marks = {tokenize.INDENT: "{", tokenize.DEDENT: "}", tokenize.NEWLINE: ";"}
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER}
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            out.append(marks.get(tok.type, tok.string))
    return " ".join(out)


def signature_of(fn) -> str:
    """Parameter names, kinds, order and defaults: what a wrapper that passes arguments on relies
    on (annotations left out: a changed type hint breaks no wrapper)."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def fingerprint(patch: Patch) -> tuple[str, str | None]:
    """(signature, source hash or None) of the installed Megatron's function at patch.target."""
    fn = _original(resolve(patch.target))
    signature = signature_of(fn)
    if not patch.body:
        return signature, None
    body = fn if patch.body_of is None else _original(resolve(patch.body_of))
    return signature, hashlib.sha256(normalized_source(body).encode()).hexdigest()[:16]


def installed_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def recorded() -> dict[str, dict[str, tuple[str, str | None]]]:
    from .fingerprints import RECORDED

    return RECORDED


def tested_versions(target: str) -> list[str]:
    """The Megatron-Core releases on which the patch of `target` was checked (fingerprint recorded)."""
    return [version for version, prints in recorded().items() if target in prints]


def check(version: str | None = None, record: dict | None = None) -> list[str]:
    """What no longer matches: one line per function, naming it ([] when all match).

    version: the Megatron-Core release the installed functions are compared as (default: the
    installed one); record: {version: {target: (signature, hash)}} (default: fingerprints.py).
    """
    version = installed_version() if version is None else version
    record = recorded() if record is None else record
    if version not in record:
        return [f"Megatron-Core {version}: no fingerprints recorded (checked: {', '.join(record) or 'none'}); "
                "check every patch in megatron_patches/patches.py against it, run the megatron tests, then "
                "`python -m megatron_patches.patches --record`"]
    expected = record[version]
    problems = []
    for patch in PATCHES:
        if patch.target not in expected:
            problems.append(f"{patch.target}: no fingerprint recorded for Megatron-Core {version}")
            continue
        try:
            signature, source = fingerprint(patch)
        except (ImportError, AttributeError) as err:
            problems.append(f"{patch.target}: not found in the installed Megatron-Core ({err})")
            continue
        want_signature, want_source = expected[patch.target]
        if signature != want_signature:
            problems.append(f"{patch.target}: signature is now {signature}, the patch was written for "
                            f"{want_signature} ({patch.replacement})")
        if source != want_source:
            inside = "it does" if patch.body_of is None else f"{patch.body_of} does"
            problems.append(f"{patch.target}: source changed (hash {source}, recorded {want_source}); the patch "
                            f"in {patch.replacement} relies on what {inside} inside")
    for target in sorted(set(expected) - set(by_target())):
        problems.append(f"{target}: recorded for Megatron-Core {version} but no longer listed in PATCHES")
    return problems


def signature_drift() -> list[str]:
    """apply()'s cheap check: the functions apply() patches whose signature differs from the newest
    record at or below the installed release (source hashes are left to the tests: a modified
    Megatron-LM checkout would trip them)."""
    from packaging.version import Version  # a dependency of megatron-core

    version = installed_version()
    older = [v for v in recorded() if Version(v) <= Version(version)]
    if not older:
        return []
    expected = recorded()[max(older, key=Version)]
    drift = []
    for patch in PATCHES:
        if patch.installed_by != APPLY or patch.target not in expected:
            continue
        try:
            signature = signature_of(_original(resolve(patch.target)))
        except ImportError:  # Megatron-Core without megatron.training: that patch is not installed either
            continue
        except AttributeError:
            drift.append(f"{patch.target} is gone")
            continue
        if signature != expected[patch.target][0]:
            drift.append(f"{patch.target}{signature} (written for {expected[patch.target][0]})")
    return drift


def warn_on_drift() -> None:
    for line in signature_drift():
        _log.warning("megatron_patches: a patched Megatron function changed: %s; see docs/megatron.md#patches", line)


def _string_lines(text: str, indent: str, width: int = 110) -> list[str]:
    """`text` as adjacent string literals of at most `width` characters, split after commas."""
    pieces, line = [], ""
    for part in text.replace(", ", ",\0 ").split("\0"):
        if line and len(line) + len(part) > width - len(indent) - 2:
            pieces.append(line)
            line = ""
        line += part
    pieces.append(line)
    return [f"{indent}{piece!r}" for piece in pieces]


def record_installed() -> str:
    """fingerprints.py's text with the installed Megatron-Core's fingerprints added (or replaced)."""
    prints = dict(recorded())
    prints[installed_version()] = {p.target: fingerprint(p) for p in PATCHES}
    lines = ["RECORDED = {"]
    for version in sorted(prints):
        lines.append(f"    {version!r}: {{")
        for target in sorted(prints[version]):
            signature, source = prints[version][target]
            lines.append(f"        {target!r}: (")
            lines += _string_lines(signature, " " * 12)
            lines[-1] += ","
            lines.append(f"            {source!r},")
            lines.append("        ),")
        lines.append("    },")
    lines.append("}")
    return _FINGERPRINTS_HEADER + "\n".join(lines) + "\n"


_FINGERPRINTS_HEADER = '''"""Fingerprints of the Megatron functions in patches.PATCHES, per Megatron-Core release.

{release: {target: (signature, hash of the normalized source, or None where the patch relies
on the signature only)}}. Written by `python -m megatron_patches.patches --record` on the
release installed, after the megatron tests pass on it; never edited by hand.
"""

'''


# -- the table --------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """docs/megatron.md's patch table (one row per Patch)."""
    rows = ["| Megatron function | replaced by | what changes | why no extension point serves | installed by | "
            "checked on |",
            "| --- | --- | --- | --- | --- | --- |"]
    for p in PATCHES:
        versions = ", ".join(tested_versions(p.target)) or "not yet"
        source = "source" if p.body_of is None else f"`{p.body_of.split(':')[1]}`'s source"
        suffix = f" (signature + {source})" if p.body else " (signature)"
        rows.append(f"| `{p.qualname}` (`{p.module}`) | `{p.replacement}` | {_cell(p.does)} | {_cell(p.reason)} | "
                    f"{p.installed_by} | {versions}{suffix} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_patches.patches", description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="compare the installed Megatron-Core with the record")
    what.add_argument("--record", action="store_true", help="record the installed Megatron-Core in fingerprints.py")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(line)
        if not problems:
            print(f"all {len(PATCHES)} patched functions match Megatron-Core {installed_version()}'s record")
        return 1 if problems else 0
    if args.record:
        import os

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fingerprints.py")
        text = record_installed()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"recorded Megatron-Core {installed_version()} in {path}")
        return 0
    print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
