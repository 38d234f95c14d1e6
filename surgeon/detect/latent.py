"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and kin) found by its tensor names.

Its keys and values are rows of one up-projection of shared latents, so no name rule of ``RULES`` fits
it: a module holding a spelling of :data:`~surgeon.detect.families.LATENTS` is read here.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import LayoutError, opt
from ..formats.base import TensorInfo
from ..vocab.blocks import AttentionBlock, Projection, Rows, owner
from .config import ConfigView, StackFacts
from .families import LATENTS, Latent, Rule
from .libraries import kv_map
from .placement import join, kind
from .refusals import check_part

LATENT_RULE = Rule("latent (MLA)", ())  # a match read by latent_block, not by parts


def latent_modules(tensors: Mapping[str, TensorInfo]) -> dict[str, Latent]:
    """The modules that hold multi-head latent attention (LATENTS), each with its spelling: its down-projection
    beside the per-head key/value up-projection and a query projection."""
    out: dict[str, Latent] = {}
    for latent in LATENTS:
        marker = "." + latent.marker + ".weight"
        for name in tensors:
            if name.endswith(marker) or name == marker[1:]:
                module = name[: -len(marker)] if name.endswith(marker) else ""
                if join(module, latent.kv + ".weight") in tensors and any(
                    join(module, q + ".weight") in tensors for q in latent.query
                ):
                    out.setdefault(module, latent)
    return out


def latent_block(
    module: str,
    latent: Latent,
    stack: str,
    layer: int,
    tensors: Mapping[str, TensorInfo],
    view: ConfigView,
    facts: StackFacts,
) -> AttentionBlock:
    """One multi-head latent attention block: per head, the query rows, the key's rows without its rotary
    part and the value rows, over the latents; the shared down-projections are not part of it."""
    where = module or "the top-level attention module"
    heads = facts.pick(facts.heads, None)
    sizes = view.latent_sizes(stack, latent, layer)
    if not isinstance(heads, int) or sizes is None:
        missing = "the number of heads" if not isinstance(heads, int) else "its head sizes"
        keys = f"{latent.nope_key}, {latent.rope_key}, {latent.value_key}"
        raise LayoutError(
            f"cannot tell {missing} of the latent attention {where}: {facts.source} does not say (it needs "
            f"num_attention_heads, {keys}); pass {opt('config', 'PATH')} with the model's config.json"
        )
    nope, rope, value = sizes
    query = next(join(module, q + ".weight") for q in latent.query if join(module, q + ".weight") in tensors)
    kv, down = tensors[join(module, latent.kv + ".weight")], tensors[join(module, latent.marker + ".weight")]
    q = tensors[query]
    for info in (q, kv, down):
        check_part(info, view, stack, module)
    width = kv.shape[1]
    want = {
        query: (heads * (nope + rope), q.shape[1]),
        kv.name: (heads * (nope + value), width),
        down.name: (width + rope, down.shape[1]),
    }
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise LayoutError(
                f"the shapes of the latent attention {where} do not fit {heads} heads of {nope}+{rope} query/key and "
                f"{value} value features from {facts.source}: {name} is {list(tensors[name].shape)}, not {list(shape)}; "
                f"check the config or pass {opt('config', 'PATH')}"
            )
    step = nope + value
    qk = nope + rope
    q_bias = join(owner(module), query.rsplit(".", 2)[-2] + ".bias")
    kv_bias = join(owner(module), latent.kv + ".bias")  # litgpt's kv_b_proj has one (config.bias); DeepSeek's none
    k_rows, v_rows = tuple(h * step for h in range(heads)), tuple(h * step + nope for h in range(heads))

    def biased(rows: tuple[int, ...], size: int) -> Rows | None:
        return Rows(kv_bias, 0, rows, size) if kv_bias in tensors else None

    return AttentionBlock(
        stack=stack,
        layer=layer,
        kind=kind(module),
        module=module,
        layout=LATENT_RULE.name,
        heads=heads,
        kv_heads=heads,
        head_dim=qk,
        q=Projection(
            "q",
            Rows(query, 0, tuple(h * qk for h in range(heads)), qk),
            Rows(q_bias, 0, tuple(h * qk for h in range(heads)), qk) if q_bias in tensors else None,
            q.shape[1],
        ),
        k=Projection("k", Rows(kv.name, 0, k_rows, nope), biased(k_rows, nope), width),
        v=Projection("v", Rows(kv.name, 0, v_rows, value), biased(v_rows, value), width),
        kv_map=kv_map(module),
    )
